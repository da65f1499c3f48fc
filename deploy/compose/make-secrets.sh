#!/bin/sh
# Makes secrets/cluster_token, secrets/api_key and secrets/grafana_admin_password (random)
# unless they exist, 0600 in a directory only this user may enter (0700), and
# secrets/grafana.env (0600) from the last. Compose bind-mounts the first two into the
# Lamina containers, which start as root only to read them (entrypoint.sh) and then run
# the service as uid 10001; Grafana (uid 472, an image we do not build) gets its password
# as a variable compose reads from grafana.env (docs/deploy.md, Secrets).
set -eu
cd "$(dirname "$0")"
umask 077
mkdir -p secrets
chmod 0700 secrets
for name in cluster_token api_key grafana_admin_password; do
    if [ ! -s "secrets/$name" ]; then
        python3 -c 'import secrets; print(secrets.token_urlsafe(32))' > "secrets/$name"
        echo "made secrets/$name"
    fi
    chmod 0600 "secrets/$name"
done
# Rewritten every time, so that a changed password file is what Grafana gets.
printf 'GF_SECURITY_ADMIN_PASSWORD=%s\n' "$(cat secrets/grafana_admin_password)" > secrets/grafana.env
chmod 0600 secrets/grafana.env
