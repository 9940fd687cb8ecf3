#!/usr/bin/env bash
# The docker-compose end-to-end check (issue #24): builds the image, starts docker-compose.yml, sends
# a streamed gRPC and a streamed HTTP request, scales to 2 schedulers and 2 workers, serves 6
# concurrent streams on both schedulers, kills a worker under load (every stream must complete),
# stops each service (none may need SIGKILL), then `docker-compose down -v`; nothing is left running.
# Prints the time of each step. Exit 0: passed, or skipped because no Docker daemon can run here.
#
# No image registry is needed: the base images come from Debian's packages
# (scripts/docker-local-bases.sh), and the build uses this machine's pip sources
# (scripts/compose_pip_sources.py serves local ones over HTTP on 127.0.0.1 to a --network host build).
set -euo pipefail
cd "$(dirname "$0")/.."

PROJECT=${PAGEDSERVE_CHECK_PROJECT:-pagedserve-check}
IMAGE=pagedserve:latest
WORK=$(mktemp -d /tmp/pagedserve-compose-check.XXXXXX)
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
DOCKERD_PID=""
KILLED=""
SERVER_PID=""
BUILD_PID=""
PIP_PORT=${PAGEDSERVE_CHECK_PIP_PORT:-38411}  # fixed: the build arguments hold it, and a new one misses the build cache
STARTED=""
TIMES=()

log() { echo "== $(date +%H:%M:%S) $*"; }
now() { date +%s.%N; }
timed() {  # timed NAME SINCE: records the seconds since SINCE
  TIMES+=("$(printf '%-28s %7.1f s' "$1" "$(echo "$(now) - $2" | bc)")")
  log "$1: $(echo "$(now) - $2" | bc | xargs printf '%.1f') s"
}
dc() { docker-compose -p "$PROJECT" --env-file "$WORK/env" "$@"; }

cleanup() {
  local status=$?
  if [ -n "$STARTED" ]; then
    [ "$status" -eq 0 ] || { log "FAILED: last logs"; dc logs --tail 30 2>&1 | tail -n 120 || true; }
    dc down -v --remove-orphans >/dev/null 2>&1 || true
  fi
  [ -z "$SERVER_PID" ] || kill "$SERVER_PID" 2>/dev/null || true
  [ -z "$BUILD_PID" ] || kill "$BUILD_PID" 2>/dev/null || true
  if [ -n "$DOCKERD_PID" ]; then
    kill "$DOCKERD_PID" 2>/dev/null || true
    wait "$DOCKERD_PID" 2>/dev/null || true
  fi
  rm -rf "$WORK"
  exit "$status"
}
trap cleanup EXIT

ensure_docker() {
  local missing=()
  command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
  command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose)
  command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
  command -v bc >/dev/null 2>&1 || missing+=(bc)
  if [ "${#missing[@]}" -gt 0 ]; then
    log "installing ${missing[*]}"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
  docker info >/dev/null 2>&1 && return 0
  log "starting dockerd (log: $WORK/dockerd.log)"
  $SUDO dockerd >"$WORK/dockerd.log" 2>&1 &
  DOCKERD_PID=$!
  for _ in $(seq 60); do
    docker info >/dev/null 2>&1 && return 0
    kill -0 "$DOCKERD_PID" 2>/dev/null || break
    sleep 1
  done
  echo "SKIPPED: the Docker daemon cannot start on this machine; the compose check did not run. dockerd said:"
  tail -n 5 "$WORK/dockerd.log"
  exit 0
}

build_image() {
  eval "$(./scripts/docker-local-bases.sh | tail -n 2)"
  export PAGEDSERVE_BASE_IMAGE PAGEDSERVE_REDIS_IMAGE
  local args=()
  mkdir "$WORK/pip"
  while IFS= read -r arg; do args+=(--build-arg "$arg"); done \
    < <(python3 scripts/compose_pip_sources.py "$WORK/pip" "$PIP_PORT")
  python3 -m http.server --bind 127.0.0.1 --directory "$WORK/pip" "$PIP_PORT" >"$WORK/pip.log" 2>&1 &
  SERVER_PID=$!
  sleep 1
  kill -0 "$SERVER_PID" 2>/dev/null || { cat "$WORK/pip.log"; echo "port $PIP_PORT is taken: set PAGEDSERVE_CHECK_PIP_PORT"; exit 1; }
  if ! curl -s -m 5 -o /dev/null https://download.pytorch.org/whl/cpu/; then
    # the PyTorch index cannot be reached: torch must come from this machine's pip sources
    local index
    index=$(printf '%s\n' "${args[@]}" | sed -n 's/^PIP_EXTRA_INDEX_URL=\(\S*\).*/\1/p; s/^PIP_INDEX_URL=\(\S*\).*/\1/p' | head -n 1)
    args+=(--build-arg "PAGEDSERVE_TORCH_INDEX_URL=${index:-https://pypi.org/simple}")
  fi
  log "docker build (${args[*]})"
  docker build --network host -t "$IMAGE" --build-arg "PAGEDSERVE_BASE_IMAGE=$PAGEDSERVE_BASE_IMAGE" "${args[@]}" . \
    >"$WORK/build.log" 2>&1 &
  BUILD_PID=$!
  wait "$BUILD_PID" || { tail -n 40 "$WORK/build.log"; exit 1; }
  BUILD_PID=""
  kill "$SERVER_PID"; SERVER_PID=""
BUILD_PID=""
PIP_PORT=${PAGEDSERVE_CHECK_PIP_PORT:-38411}  # fixed: the build arguments hold it, and a new one misses the build cache
  log "image $IMAGE: $(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.2f GB", $1 / 1e9}')"
  # the run-time image: no compiler, no triton, the C++ op loads without a build
  docker run --rm --entrypoint sh "$IMAGE" -c '! command -v g++ && ! command -v gcc && ! python -c "import triton" 2>/dev/null && python -c "
import sys; from pagedserve.engine.attention.cpu_op import load_cpu_attention_op as load; sys.exit(load() is None)"' \
    || { echo "the run-time image has a compiler or triton, or its C++ op does not load"; exit 1; }
}

write_env() {
  local free
  free=$(python3 -c '
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks: s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')
  read -r GRPC_PORT HTTP_PORT <<<"$free"
  API_KEY=$(openssl rand -hex 24)
  cat >"$WORK/env" <<EOF
PAGEDSERVE_CLUSTER_TOKEN=$(openssl rand -hex 32)
PAGEDSERVE_REDIS_PASSWORD=$(openssl rand -hex 24)
PAGEDSERVE_API_KEY=$API_KEY
PAGEDSERVE_GRPC_PORT=$GRPC_PORT
PAGEDSERVE_HTTP_PORT=$HTTP_PORT
PAGEDSERVE_REDIS_IMAGE=$PAGEDSERVE_REDIS_IMAGE
EOF
}

wait_healthy() {  # wait_healthy SERVICE COUNT: until COUNT containers of SERVICE are healthy (3 minutes)
  for _ in $(seq 180); do
    local healthy=0 id
    for id in $(dc ps -q "$1"); do
      [ "$(docker inspect -f '{{.State.Health.Status}}' "$id")" = healthy ] && healthy=$((healthy + 1))
    done
    [ "$healthy" -ge "$2" ] && return 0
    sleep 1
  done
  echo "$1: fewer than $2 healthy containers after 3 minutes"; exit 1
}

first_tokens() {
  local t
  t=$(now)
  docker exec "$(dc ps -q gateway)" pagedserve complete --target 127.0.0.1:50051 --api-key "$API_KEY" \
    --prompt "The capital of France is" --max-tokens 8 | tee "$WORK/grpc.txt"
  [ -s "$WORK/grpc.txt" ] || { echo "the gRPC stream gave no text"; exit 1; }
  timed "first token, gRPC (8 tokens)" "$t"
  t=$(now)
  curl -sfN -m 60 "http://127.0.0.1:$HTTP_PORT/v1/completions" -H "Authorization: Bearer $API_KEY" \
    -H 'Content-Type: application/json' \
    -d '{"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 8, "stream": true}' \
    >"$WORK/http.txt"
  head -c 300 "$WORK/http.txt"; echo
  grep -q '^data: {' "$WORK/http.txt" && grep -q '^data: \[DONE\]' "$WORK/http.txt" \
    || { echo "the HTTP stream is not a complete server-sent event stream"; exit 1; }
  timed "first token, HTTP (8 tokens)" "$t"
  # a kernel the image could not build leaves the worker on a slower fallback with only a warning
  ! dc logs worker 2>&1 | grep "could not be built" || { echo "a kernel did not build in the image"; exit 1; }
}

requests_per_scheduler() {  # requests each scheduler has seen go through its waiting phase
  local id
  for id in $(dc ps -q scheduler); do
    docker exec "$id" python -c '
import re, urllib.request
text = urllib.request.urlopen("http://127.0.0.1:9090/metrics").read().decode()
print(sum(float(v) for v in re.findall(r"^vllm:request_queue_time_seconds_count\{.*\} (\S+)$", text, re.M)))'
  done
}

run_streams() {  # run_streams KILL: 6 concurrent 48-token streams; KILL=1 kills a worker once they stream
  local t load victim
  t=$(now)
  : >"$WORK/load.txt"
  docker exec -i "$(dc ps -q gateway)" python - 6 48 <scripts/compose_load.py >"$WORK/load.txt" 2>&1 &
  load=$!
  if [ "$1" = 1 ]; then
    for _ in $(seq 300); do grep -q STREAMING "$WORK/load.txt" && break; sleep 0.2; done
    victim=$(dc ps -q worker | tail -n 1)
    log "6 streams running; killing worker container $(docker inspect -f '{{.Name}}' "$victim")"
    docker kill "$victim" >/dev/null
    KILLED=$victim
  fi
  wait "$load" || { cat "$WORK/load.txt"; echo "a stream did not complete"; exit 1; }
  cat "$WORK/load.txt"
  timed "6 streams$([ "$1" = 1 ] && echo ", a worker killed")" "$t"
}

streams_on_both_schedulers() {
  local before after i served=0
  mapfile -t before < <(requests_per_scheduler)
  run_streams 0
  mapfile -t after < <(requests_per_scheduler)
  for i in "${!after[@]}"; do
    echo "scheduler $i: $(echo "${after[$i]} - ${before[$i]:-0}" | bc) of these requests"
    [ "$(echo "${after[$i]} > ${before[$i]:-0}" | bc)" -eq 1 ] && served=$((served + 1))
  done
  [ "$served" -ge 2 ] || { echo "the requests were not served by both schedulers"; exit 1; }
}

stop_each_service() {  # every service stops on SIGTERM within its grace period (exit code not 137)
  local service id t
  for service in gateway worker scheduler; do
    t=$(now)
    dc stop "$service" >/dev/null 2>&1
    timed "docker-compose stop $service" "$t"
    for id in $(dc ps -a -q "$service"); do
      local state
      state=$(docker inspect -f '{{.Name}} exit {{.State.ExitCode}} oom {{.State.OOMKilled}}' "$id")
      echo "  $state"
      case "$state" in *"exit 137"*) [ "$id" = "$KILLED" ] || { echo "$service was killed (SIGKILL)"; exit 1; } ;; esac
    done
  done
}

main() {
  local t
  ensure_docker
  t=$(now); build_image; timed "build" "$t"
  write_env
  STARTED=1
  t=$(now); dc up -d --no-build >/dev/null 2>&1 || dc up -d --no-build; wait_healthy gateway 1; timed "up (healthy)" "$t"
  first_tokens
  t=$(now)
  dc up -d --no-build --scale worker=2 --scale scheduler=2 >/dev/null 2>&1
  wait_healthy scheduler 2; wait_healthy worker 2; wait_healthy gateway 1
  timed "scale to 2+2 (healthy)" "$t"
  streams_on_both_schedulers
  run_streams 1
  stop_each_service
  t=$(now); dc down -v --remove-orphans >/dev/null 2>&1; STARTED=""; timed "down -v" "$t"
  local left
  left=$(docker ps -aq --filter "label=com.docker.compose.project=$PROJECT"; docker volume ls -q --filter "label=com.docker.compose.project=$PROJECT")
  [ -z "$left" ] || { echo "left after down -v: $left"; exit 1; }
  echo "compose check passed; image $(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.2f GB", $1 / 1e9}')"
  printf '  %s\n' "${TIMES[@]}"
}

main
