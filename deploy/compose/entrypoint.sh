#!/bin/sh
# Secrets as files (compose secrets, Kubernetes secret volumes): LAMINA_X_FILE=path sets
# LAMINA_X from that file, so tokens never appear in the container's definition.
# Started as root (compose.yaml does, so that it can read secret files that are 0600 and
# owned by whoever made them), it runs the service as the image's user, uid 10001;
# started as that user (the image's default, Kubernetes), it runs it as it is.
set -eu
for var in LAMINA_CLUSTER_TOKEN LAMINA_API_KEY REDIS_URL; do
    eval "path=\${${var}_FILE:-}"
    if [ -n "$path" ]; then
        value=$(cat "$path")
        export "$var=$value"
        unset "${var}_FILE"
    fi
done
if [ "$(id -u)" = 0 ]; then
    export HOME=/home/lamina USER=lamina LOGNAME=lamina
    exec setpriv --reuid=lamina --regid=lamina --init-groups lamina "$@"
fi
exec lamina "$@"
