#!/usr/bin/env bash
# Make sure the servers the test suite talks to answer on 127.0.0.1, and start any that do not:
#   Redis 127.0.0.1:6379, PostgreSQL 127.0.0.1:5432, MariaDB 127.0.0.1:3306, RabbitMQ 127.0.0.1:5672.
#
# It never stops, restarts or flushes a server: one that answers is left alone. Each wait is a
# bounded poll (SERVICES_TIMEOUT seconds, default 60). Exit status 0 when every installed server
# answers; 1, with the reason, when one does not come up. A server that is not installed is an
# error in CI (CI=true: its tests would fail there) and a warning elsewhere (its tests skip).
#
# Usage: bash scripts/services.sh
set -euo pipefail

TIMEOUT="${SERVICES_TIMEOUT:-60}"

say() { printf 'services: %s\n' "$*"; }
die() { printf 'services: ERROR: %s\n' "$*" >&2; exit 1; }

in_ci() {
    case "${CI:-}" in 1 | true | TRUE | True | yes) return 0 ;; *) return 1 ;; esac
}

# A TCP connect to 127.0.0.1:$1 within 3 s (used when a server's own client is missing).
tcp_open() {
    timeout 3 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1" >/dev/null 2>&1
}

# -- probes: succeed when the server answers a real request ----------------------------------

redis_answers() {
    if command -v redis-cli >/dev/null 2>&1; then
        [ "$(timeout 3 redis-cli -h 127.0.0.1 -p 6379 ping 2>/dev/null)" = "PONG" ]
    else
        timeout 3 bash -c 'exec 3<>/dev/tcp/127.0.0.1/6379 && printf "PING\r\n" >&3 &&
            IFS= read -r line <&3 && [[ $line == +PONG* ]]' >/dev/null 2>&1
    fi
}

postgres_answers() {
    if command -v pg_isready >/dev/null 2>&1; then
        pg_isready -q -h 127.0.0.1 -p 5432 -t 3
    else
        tcp_open 5432
    fi
}

mariadb_answers() {
    if command -v mysqladmin >/dev/null 2>&1; then
        # "ping" exits 0 whenever the server is up, even if this user may not log in.
        timeout 5 mysqladmin --protocol=TCP -h 127.0.0.1 -P 3306 --user=root \
            --connect-timeout=3 ping >/dev/null 2>&1
    else
        tcp_open 3306
    fi
}

rabbitmq_answers() {
    # An AMQP server answers a protocol header it does not speak with its own ("AMQP\0\0\9\1").
    timeout 3 bash -c 'exec 3<>/dev/tcp/127.0.0.1/5672 && printf "AMQP\1\1\0\0" >&3 &&
        head -c 4 <&3 | grep -q AMQP' >/dev/null 2>&1
}

# -- start commands (the machine's own; each is a no-op for a server that already runs) -------

redis_start() {
    mkdir -p /var/lib/redis /var/log/redis
    redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
        --dir /var/lib/redis --logfile /var/log/redis/ci.log
}

postgres_version() {
    # The newest cluster version configured on the machine (normally the only one).
    ls /etc/postgresql 2>/dev/null | sort -V | tail -n 1
}

postgres_start() {
    local version
    version="$(postgres_version)"
    [ -n "$version" ] || { say "no cluster under /etc/postgresql"; return 1; }
    pg_ctlcluster --skip-systemctl-redirect "$version" main start
}

mariadb_start() {
    # The socket directory lives on a tmpfs that a reboot empties.
    if [ ! -d /run/mysqld ] && id mysql >/dev/null 2>&1; then
        install -d -m 0755 -o mysql -g mysql /run/mysqld
    fi
    start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd
}

rabbitmq_start() {
    rabbitmq-server -detached
}

# ensure NAME PORT PROBE START BINARY LOGHINT
ensure() {
    local name="$1" port="$2" probe="$3" start="$4" binary="$5" loghint="$6"
    if "$probe"; then
        say "$name answers on 127.0.0.1:$port"
        return 0
    fi
    if ! command -v "$binary" >/dev/null 2>&1 && [ ! -x "$binary" ]; then
        if in_ci; then
            die "$name does not answer on 127.0.0.1:$port and $binary is not installed"
        fi
        say "WARNING: $name does not answer on 127.0.0.1:$port and $binary is not installed;" \
            "the tests that need it will be skipped"
        return 0
    fi
    say "$name does not answer on 127.0.0.1:$port; starting it"
    local rc=0
    "$start" || rc=$?
    [ "$rc" -eq 0 ] || say "the $name start command exited $rc; waiting for it anyway"
    local start_s=$SECONDS
    while ! "$probe"; do
        if [ $((SECONDS - start_s)) -ge "$TIMEOUT" ]; then
            die "$name did not answer on 127.0.0.1:$port within ${TIMEOUT} s ($loghint)"
        fi
        sleep 0.5
    done
    say "$name answers on 127.0.0.1:$port (after $((SECONDS - start_s)) s)"
}

ensure "Redis" 6379 redis_answers redis_start redis-server "log: /var/log/redis/ci.log"
ensure "PostgreSQL" 5432 postgres_answers postgres_start pg_ctlcluster \
    "log: /var/log/postgresql/postgresql-$(postgres_version)-main.log"
ensure "MariaDB" 3306 mariadb_answers mariadb_start /usr/sbin/mariadbd \
    "run /usr/sbin/mariadbd in the foreground to see why"
ensure "RabbitMQ" 5672 rabbitmq_answers rabbitmq_start rabbitmq-server \
    "log: /var/log/rabbitmq/"
say "all servers answer"
