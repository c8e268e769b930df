#!/usr/bin/env bash
# Start (or stop) the PostgreSQL and Redis that the test suite runs against, on loopback,
# with their data under var/services/. Installs Debian's packages first when missing and we
# are root (also Chromium + driver, promtool and Alertmanager, which tests start themselves).
# Writes var/services/env with the EXITPLANE_TEST_* URLs for the test run.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
dir="$root/var/services"
pg_port=${EXITPLANE_TEST_PG_PORT:-55432}
redis_port=${EXITPLANE_TEST_REDIS_PORT:-56379}
mkdir -p "$dir"

pg_bin() {
  local found
  found=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)
  echo "$found"
}

as_pg() {
  # PostgreSQL refuses to run as root: use the postgres system user then.
  if [ "$(id -u)" = 0 ]; then su postgres -s /bin/bash -c "$*"; else bash -c "$*"; fi
}

install_missing() {
  local missing=()
  [ -n "$(pg_bin)" ] && [ -x "$(pg_bin)/postgres" ] || missing+=(postgresql)
  command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
  # The browser tests drive Debian's Chromium; the alert tests use promtool and Alertmanager.
  command -v chromium >/dev/null 2>&1 || missing+=(chromium)
  command -v chromedriver >/dev/null 2>&1 || missing+=(chromium-driver)
  command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
  command -v prometheus-alertmanager >/dev/null 2>&1 || missing+=(prometheus-alertmanager)
  if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" != 0 ]; then
      echo "services.sh: missing ${missing[*]}; install them (apt-get install ${missing[*]})" >&2
      exit 2
    fi
    echo "services.sh: installing ${missing[*]} from Debian's packages" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    # Debian starts its own instances on the default ports; ours run on their own ports.
  fi
}

start_pg() {
  local bin data sock
  bin=$(pg_bin)
  data="$dir/pg"
  sock="$dir/pgsock"
  mkdir -p "$sock"
  if [ "$(id -u)" = 0 ]; then chown postgres "$dir" "$sock"; chmod 755 "$dir"; fi
  if [ ! -f "$data/PG_VERSION" ]; then
    mkdir -p "$data"
    [ "$(id -u)" = 0 ] && chown postgres "$data"
    as_pg "'$bin/initdb' -D '$data' -U postgres --auth=trust -E UTF8 >/dev/null"
  fi
  if ! as_pg "'$bin/pg_ctl' -D '$data' status" >/dev/null 2>&1; then
    as_pg "'$bin/pg_ctl' -D '$data' -l '$dir/pg.log' -w -t 60 \
      -o \"-p $pg_port -k '$sock' -c listen_addresses=127.0.0.1 -c fsync=off \
          -c synchronous_commit=off -c full_page_writes=off -c max_connections=300\" start" >/dev/null
  fi
  for db in exitplane_test exitplane_bench; do
    as_pg "'$bin/psql' -h 127.0.0.1 -p $pg_port -U postgres -tAc \
      \"SELECT 1 FROM pg_database WHERE datname='$db'\" | grep -q 1 || \
      '$bin/createdb' -h 127.0.0.1 -p $pg_port -U postgres $db"
  done
}

start_redis() {
  if ! redis-cli -p "$redis_port" ping >/dev/null 2>&1; then
    mkdir -p "$dir/redis"
    redis-server --port "$redis_port" --bind 127.0.0.1 --daemonize yes --save '' \
      --appendonly no --dir "$dir/redis" --pidfile "$dir/redis.pid" --logfile "$dir/redis.log"
    for _ in $(seq 50); do redis-cli -p "$redis_port" ping >/dev/null 2>&1 && break; sleep 0.1; done
  fi
}

stop_all() {
  local bin
  bin=$(pg_bin)
  [ -f "$dir/pg/PG_VERSION" ] && as_pg "'$bin/pg_ctl' -D '$dir/pg' -m fast stop" >/dev/null 2>&1 || true
  redis-cli -p "$redis_port" shutdown nosave >/dev/null 2>&1 || true
}

case "${1:-start}" in
  start)
    install_missing
    start_pg
    start_redis
    cat > "$dir/env" <<ENV
export EXITPLANE_TEST_POSTGRES_URL=postgresql+psycopg://postgres@127.0.0.1:$pg_port/exitplane_test
export EXITPLANE_TEST_REDIS_URL=redis://127.0.0.1:$redis_port/0
export EXITPLANE_BENCH_POSTGRES_URL=postgresql+psycopg://postgres@127.0.0.1:$pg_port/exitplane_bench
ENV
    echo "services.sh: PostgreSQL on 127.0.0.1:$pg_port, Redis on 127.0.0.1:$redis_port" >&2
    ;;
  stop) stop_all ;;
  *) echo "usage: scripts/services.sh start|stop" >&2; exit 2 ;;
esac
