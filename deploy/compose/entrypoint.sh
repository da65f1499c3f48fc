#!/bin/sh
# Secrets as files (compose secrets, Kubernetes secret volumes): LAMINA_X_FILE=path sets
# LAMINA_X from that file, so tokens never appear in the container's definition.
set -eu
for var in LAMINA_CLUSTER_TOKEN LAMINA_API_KEY REDIS_URL; do
    eval "path=\${${var}_FILE:-}"
    if [ -n "$path" ]; then
        value=$(cat "$path")
        export "$var=$value"
        unset "${var}_FILE"
    fi
done
exec lamina "$@"
