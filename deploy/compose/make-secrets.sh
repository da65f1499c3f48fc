#!/bin/sh
# Makes secrets/cluster_token and secrets/api_key (random) unless they exist. They are
# bind-mounted into the containers, whose user (uid 10001) must be able to read them.
set -eu
cd "$(dirname "$0")"
mkdir -p secrets
for name in cluster_token api_key; do
    if [ ! -s "secrets/$name" ]; then
        python3 -c 'import secrets; print(secrets.token_urlsafe(32))' > "secrets/$name"
        chmod 0644 "secrets/$name"
        echo "made secrets/$name"
    fi
done
