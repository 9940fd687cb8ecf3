#!/usr/bin/env bash
# Builds, without any image registry, the base images docker-compose.yml needs where Docker Hub
# cannot be reached: Debian bookworm from this machine's own apt source (debootstrap, then
# `docker import`) as $PAGEDSERVE_BASE_IMAGE, and Redis on it as $PAGEDSERVE_REDIS_IMAGE.
# Images already present are kept. Needs root, debootstrap and a running Docker daemon.
# Prints the two image names as shell assignments (eval them) on its last two lines.
set -euo pipefail

BASE_IMAGE=${PAGEDSERVE_BASE_IMAGE:-pagedserve-base:bookworm}
REDIS_IMAGE=${PAGEDSERVE_REDIS_IMAGE:-pagedserve-redis:bookworm}

apt_mirror() {  # the first Debian archive this machine's apt reads (deb822 or one-line sources)
  local files=(/etc/apt/sources.list /etc/apt/sources.list.d/*)
  local uri
  uri=$(cat "${files[@]}" 2>/dev/null | sed -n -E 's/^URIs: *(\S+\/debian)\/?$/\1/p; s/^deb +(\[[^]]*\] +)?(\S+\/debian)\/? +.*/\2/p' | head -n 1)
  echo "${uri:-http://deb.debian.org/debian}"
}

if ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
  mirror=$(apt_mirror)
  root=$(mktemp -d /tmp/pagedserve-rootfs.XXXXXX)
  trap 'rm -rf "$root"' EXIT
  echo "== debootstrap bookworm from $mirror into $root (a few minutes)" >&2
  debootstrap --variant=minbase --include=ca-certificates bookworm "$root" "$mirror" >"$root.log" 2>&1 \
    || { tail -n 20 "$root.log" >&2; echo "debootstrap failed (log: $root.log)" >&2; exit 1; }
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root.log"
  echo "== docker import as $BASE_IMAGE" >&2
  tar -C "$root" -c . | docker import --change 'CMD ["bash"]' - "$BASE_IMAGE" >/dev/null
fi

if ! docker image inspect "$REDIS_IMAGE" >/dev/null 2>&1; then
  echo "== building $REDIS_IMAGE (Debian's redis-server on $BASE_IMAGE)" >&2
  docker build -q -t "$REDIS_IMAGE" - >/dev/null <<DOCKERFILE
FROM $BASE_IMAGE
RUN apt-get update && apt-get install -y --no-install-recommends redis-server && rm -rf /var/lib/apt/lists/*
CMD ["redis-server"]
DOCKERFILE
fi

echo "PAGEDSERVE_BASE_IMAGE=$BASE_IMAGE"
echo "PAGEDSERVE_REDIS_IMAGE=$REDIS_IMAGE"
