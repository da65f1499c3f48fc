#!/bin/sh
# Makes secrets/cluster_token, secrets/api_key and secrets/grafana_admin_password (random)
# unless they exist, in a directory only this user may enter (0700). They are bind-mounted
# into the containers, whose users (uid 10001, Grafana's 472) read them there, so the
# files themselves stay readable (0644): the directory is what keeps other users of this
# host out.
set -eu
cd "$(dirname "$0")"
umask 077
mkdir -p secrets
chmod 0700 secrets
for name in cluster_token api_key grafana_admin_password; do
    if [ ! -s "secrets/$name" ]; then
        python3 -c 'import secrets; print(secrets.token_urlsafe(32))' > "secrets/$name"
        chmod 0644 "secrets/$name"
        echo "made secrets/$name"
    fi
done
