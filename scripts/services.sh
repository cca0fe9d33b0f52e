#!/usr/bin/env bash
# Bring up the backing services the fenced test suite talks to, all on 127.0.0.1:
#
#   MariaDB  :3306  (root over TCP with an empty password, database `test`)
#   Redis    :6379
#   Redis Cluster :7000-7005 (3 primaries, 3 replicas; bus ports 17000-17005)
#   etcd     :2379  (client) / :2380 (peer)
#   ZooKeeper :2181 (standalone, its own data dir, a 256 MiB heap)
#   PostgreSQL :5432 (role `postgres` over TCP without a password, database
#                     `fenced_test`, max_connections >= 200)
#
# and make sure `protoc` exists (the etcd-client crate needs it at build time).
#
# Idempotent: a service that already answers is left alone. Otherwise it is
# installed with apt if its binaries are missing, started, and waited for (at
# most WAIT_SECS). Works on a box where everything already runs and on a fresh
# Debian 12 box with nothing installed. There is no systemd as PID 1 on the
# machines this runs on, so daemons are started directly rather than via
# systemctl. Needs root only when it has to install or start something.
set -euo pipefail

WAIT_SECS=60                          # how long to wait for a service to answer
APT_LOG=/var/log/fenced-ci-apt.log    # apt output goes here to keep our output short
ETCD_DATA_DIR=/var/lib/fenced-etcd    # our own data dir, separate from the package's
ETCD_LOG=/var/log/fenced-etcd.log
REDIS_LOG=/var/log/redis/ci.log
REDIS_CLUSTER_PORTS=(7000 7001 7002 7003 7004 7005)
REDIS_CLUSTER_DIR=/var/lib/fenced-redis-cluster   # one data dir per node: <dir>/<port>
MARIADB_LOG=/var/log/mysql/fenced-ci.log   # mariadbd's stdout/stderr
ZK_DIR=/var/lib/fenced-zookeeper      # our own config and data dir, separate from the package's
ZK_LOG=/var/log/fenced-zookeeper.log
PG_PORT=5432
PG_DATABASE=fenced_test
PG_MIN_CONNECTIONS=200                # below this the limit is raised ...
PG_MAX_CONNECTIONS=300                # ... to this
PG_DATA_DIR=/var/lib/fenced-postgres  # our own cluster, only where Debian's cluster is missing
PG_LOG=/var/log/postgresql/fenced-postgres.log

APT_UPDATED=0   # run `apt-get update` at most once, and only if we install something
WAITED=0        # set by wait_for: seconds it took a service to answer

die() {
    printf 'services.sh: ERROR: %s\n' "$*" >&2
    exit 1
}

have() { command -v "$1" >/dev/null 2>&1; }

# Print the last lines of a log file to stderr (used just before dying).
show_log() {
    if [ -r "$1" ]; then
        printf -- '--- last lines of %s ---\n' "$1" >&2
        tail -n 20 "$1" >&2 || true
    fi
}

apt_install() {
    [ "$(id -u)" = 0 ] || die "need root to apt-get install $*"
    if [ "$APT_UPDATED" = 0 ]; then
        apt-get update >>"$APT_LOG" 2>&1 || { show_log "$APT_LOG"; die "apt-get update failed"; }
        APT_UPDATED=1
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y "$@" >>"$APT_LOG" 2>&1 \
        || { show_log "$APT_LOG"; die "apt-get install $* failed"; }
}

# --- health probes ---------------------------------------------------------
# These use bash's /dev/tcp so they work before any client tools are installed.

# Something accepts TCP connections on 127.0.0.1:$1.
port_open() {
    timeout 2 bash -c 'exec 3<>"/dev/tcp/127.0.0.1/$1"' _ "$1" 2>/dev/null
}

# MariaDB only opens its port once it is ready to serve, so a connect is enough;
# the SQL-level check happens in mariadb_ensure_access.
mariadb_answers() { port_open 3306; }

# ZooKeeper answers the `srvr` command (on the default whitelist) with its
# mode once it serves requests.
zookeeper_answers() {
    local reply
    reply=$(timeout 3 bash -c \
        'exec 3<>/dev/tcp/127.0.0.1/2181 && printf "srvr" >&3 && cat <&3' \
        2>/dev/null) || return 1
    [[ $reply == *'Mode: '* ]]
}

# Redis replies +PONG to an inline PING.
redis_answers() {
    local reply
    reply=$(timeout 2 bash -c \
        'exec 3<>/dev/tcp/127.0.0.1/6379 && printf "PING\r\n" >&3 && head -c 5 <&3' \
        2>/dev/null) || return 1
    [ "$reply" = "+PONG" ]
}

# etcd's /health endpoint returns {"health":"true",...} once it has a leader.
etcd_answers() {
    local reply
    reply=$(timeout 3 bash -c \
        'exec 3<>/dev/tcp/127.0.0.1/2379 &&
         printf "GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n" >&3 && cat <&3' \
        2>/dev/null) || return 1
    [[ $reply == *'"health":"true"'* ]]
}

# True if process $1 exists and is not a zombie (a dead child of ours stays a
# zombie until reaped, and `kill -0` succeeds on zombies).
alive() {
    local state
    state=$(cut -d' ' -f3 "/proc/$1/stat" 2>/dev/null) && [ "$state" != Z ]
}

# wait_for NAME PROBE LOGFILE [PID]
# Poll PROBE once a second until it succeeds; die after WAIT_SECS, or as soon as
# PID (if given) exits. Sets WAITED to the number of seconds it took.
wait_for() {
    local name=$1 probe=$2 logfile=$3 pid=${4:-} start=$SECONDS
    until "$probe"; do
        if [ -n "$pid" ] && ! alive "$pid"; then
            show_log "$logfile"
            die "$name exited during startup; see $logfile"
        fi
        if ((SECONDS - start >= WAIT_SECS)); then
            show_log "$logfile"
            die "$name did not answer on 127.0.0.1 within ${WAIT_SECS}s; see $logfile"
        fi
        sleep 1
    done
    WAITED=$((SECONDS - start))
}

# report NAME PART...: print "NAME: PART, PART, ..." (one line per service).
report() {
    local name=$1 line=$2 part
    shift 2
    for part in "$@"; do line+=", $part"; done
    printf '%s: %s\n' "$name" "$line"
}

# --- MariaDB ---------------------------------------------------------------

# The tests connect as root over TCP with an empty password to database `test`.
# Debian's root@localhost uses unix_socket auth, which does not work over TCP, so
# fix that up (via the unix socket, as OS root) unless it already works.
mariadb_tcp_ok() {
    # Retried: a busy server may refuse for a moment ("Too many connections").
    local try
    for try in 1 2 3 4 5; do
        if mariadb --connect-timeout=5 -h127.0.0.1 -P3306 -uroot -e 'SELECT 1' test >/dev/null 2>&1; then
            return 0
        fi
        sleep 2
    done
    return 1
}

# The suites open many short-lived pools in parallel (row_lock holds one
# connection per held lock); the stock limit of 151 is too tight for them.
mariadb_raise_connection_limit() {
    mariadb -h127.0.0.1 -P3306 -uroot -e \
        'SET GLOBAL max_connections = GREATEST(@@GLOBAL.max_connections, 1000)' >/dev/null 2>&1 \
        && did+=("max_connections >= 1000")
}

mariadb_ensure_access() {
    # The server may run without the client installed (another package set,
    # a container image): install the client rather than skip the check.
    if ! have mariadb; then
        apt_install mariadb-client
        have mariadb || die "installed mariadb-client, but there is still no \`mariadb\` command on PATH"
        did+=("installed mariadb-client for the root/test check")
    fi
    if mariadb_tcp_ok; then
        did+=("root@127.0.0.1 and database test OK")
        return
    fi
    # A TCP connection from 127.0.0.1 may be matched against root@localhost
    # (when name resolution is on) or root@127.0.0.1, so make both accept an
    # empty password. root@localhost keeps unix_socket as an alternative.
    mariadb -uroot <<'SQL' || die "mariadb: could not fix root access via the unix socket (is OS root allowed in as root@localhost?)"
CREATE DATABASE IF NOT EXISTS test;
ALTER USER 'root'@'localhost' IDENTIFIED VIA mysql_native_password USING PASSWORD('') OR unix_socket;
CREATE USER IF NOT EXISTS 'root'@'127.0.0.1' IDENTIFIED VIA mysql_native_password USING PASSWORD('');
ALTER USER 'root'@'127.0.0.1' IDENTIFIED VIA mysql_native_password USING PASSWORD('');
GRANT ALL PRIVILEGES ON *.* TO 'root'@'127.0.0.1' WITH GRANT OPTION;
FLUSH PRIVILEGES;
SQL
    mariadb_tcp_ok || die "mariadb: root still cannot log in over TCP to database test"
    did+=("configured root@127.0.0.1 (empty password) and database test")
}

setup_mariadb() {
    local did=()
    if mariadb_answers; then
        did+=("already running")
    else
        if [ ! -x /usr/sbin/mariadbd ] || ! have mariadb; then
            apt_install mariadb-server mariadb-client
            did+=("installed mariadb-server")
        fi
        # Where policy-rc.d does not block it, the package's postinst starts the
        # server through its init script (which waits until it is up).
        if mariadb_answers; then
            did+=("started by the package")
        else
            # The package normally initialises the data dir; do it if it didn't.
            if [ ! -d /var/lib/mysql/mysql ]; then
                mariadb-install-db --user=mysql --datadir=/var/lib/mysql >>"$MARIADB_LOG" 2>&1 \
                    || { show_log "$MARIADB_LOG"; die "mariadb-install-db failed"; }
                did+=("initialised /var/lib/mysql")
            fi
            # Normally created by the init script / tmpfiles; /run is a tmpfs.
            install -d -o mysql -g mysql -m 0755 /run/mysqld
            mkdir -p "$(dirname "$MARIADB_LOG")"
            # --user/--bind-address/--port on the command line override my.cnf,
            # so this does not depend on how the config files look.
            start-stop-daemon --start --oknodo --background --output "$MARIADB_LOG" \
                --exec /usr/sbin/mariadbd -- --user=mysql --bind-address=127.0.0.1 --port=3306
            wait_for mariadb mariadb_answers "$MARIADB_LOG"
            did+=("started, answering after ${WAITED}s")
        fi
    fi
    mariadb_ensure_access
    mariadb_raise_connection_limit
    report mariadb "${did[@]}"
}

# --- Redis -----------------------------------------------------------------

setup_redis() {
    local did=()
    if redis_answers; then
        report redis "already running"
        return
    fi
    if ! have redis-server || ! have redis-cli; then
        apt_install redis-server redis-tools
        did+=("installed redis-server")
    fi
    if redis_answers; then
        did+=("started by the package")
    else
        mkdir -p /var/lib/redis "$(dirname "$REDIS_LOG")"
        # No persistence: the tests only need a scratch instance.
        redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 \
            --save "" --appendonly no --dir /var/lib/redis --logfile "$REDIS_LOG"
        wait_for redis redis_answers "$REDIS_LOG"
        did+=("started, answering after ${WAITED}s")
    fi
    report redis "${did[@]}"
}

# --- Redis Cluster -----------------------------------------------------------
# Six nodes on 7000-7005, formed with `redis-cli --cluster create` into three
# primaries with one replica each. No persistence; nodes.conf (the cluster's
# own state) lives in each node's directory, so a restart keeps the cluster.

# Every node answers PING and sees the cluster as ok.
redis_cluster_ok() {
    local p
    for p in "${REDIS_CLUSTER_PORTS[@]}"; do
        redis-cli -p "$p" cluster info 2>/dev/null | grep -q '^cluster_state:ok' || return 1
    done
}

redis_cluster_start_nodes() {
    local p
    for p in "${REDIS_CLUSTER_PORTS[@]}"; do
        if ! redis-cli -p "$p" ping >/dev/null 2>&1; then
            mkdir -p "$REDIS_CLUSTER_DIR/$p"
            redis-server --daemonize yes --bind 127.0.0.1 --port "$p" \
                --cluster-enabled yes --cluster-config-file nodes.conf \
                --cluster-node-timeout 2000 --save "" --appendonly no \
                --dir "$REDIS_CLUSTER_DIR/$p" --logfile "$REDIS_CLUSTER_DIR/$p/redis.log"
        fi
    done
    for p in "${REDIS_CLUSTER_PORTS[@]}"; do
        local start=$SECONDS
        until redis-cli -p "$p" ping >/dev/null 2>&1; do
            ((SECONDS - start < WAIT_SECS)) || {
                show_log "$REDIS_CLUSTER_DIR/$p/redis.log"
                die "redis cluster node $p did not answer within ${WAIT_SECS}s"
            }
            sleep 0.2
        done
    done
}

# Waits until redis_cluster_ok, at most $1 seconds; false when it is not.
redis_cluster_wait() {
    local start=$SECONDS
    until redis_cluster_ok; do
        ((SECONDS - start < $1)) || return 1
        sleep 0.5
    done
}

redis_cluster_create() {
    local nodes=() p
    for p in "${REDIS_CLUSTER_PORTS[@]}"; do nodes+=("127.0.0.1:$p"); done
    redis-cli --cluster create "${nodes[@]}" --cluster-replicas 1 --cluster-yes \
        >"$REDIS_CLUSTER_DIR/create.log" 2>&1 || {
        show_log "$REDIS_CLUSTER_DIR/create.log"
        die "redis-cli --cluster create failed"
    }
}

setup_redis_cluster() {
    if redis_cluster_ok; then
        report redis-cluster "already running"
        return
    fi
    local did=()
    redis_cluster_start_nodes
    if redis_cluster_wait 10; then
        report redis-cluster "started its nodes, formed from their saved state"
        return
    fi
    # Not formed, or a broken leftover: start from empty nodes.
    if [ "$(redis-cli -p "${REDIS_CLUSTER_PORTS[0]}" cluster info | grep -c '^cluster_slots_assigned:0')" = 0 ]; then
        local p
        for p in "${REDIS_CLUSTER_PORTS[@]}"; do
            redis-cli -p "$p" shutdown nosave >/dev/null 2>&1 || true
        done
        sleep 1
        rm -rf "$REDIS_CLUSTER_DIR"
        redis_cluster_start_nodes
        did+=("reset a broken cluster")
    fi
    redis_cluster_create
    redis_cluster_wait "$WAIT_SECS" || {
        redis-cli -p "${REDIS_CLUSTER_PORTS[0]}" cluster info >&2 || true
        die "the redis cluster on ${REDIS_CLUSTER_PORTS[*]} is not ok after ${WAIT_SECS}s"
    }
    report redis-cluster "created (3 primaries, 3 replicas)" "${did[@]}"
}

# --- etcd ------------------------------------------------------------------

setup_etcd() {
    local did=() pid
    if etcd_answers; then
        report etcd "already running"
        return
    fi
    if [ ! -x /usr/bin/etcd ] || ! have etcdctl; then
        apt_install etcd-server etcd-client
        did+=("installed etcd-server")
    fi
    if etcd_answers; then
        did+=("started by the package")
    else
        mkdir -p "$ETCD_DATA_DIR"
        chmod 700 "$ETCD_DATA_DIR"   # etcd warns about looser permissions
        # Single-member cluster on loopback only. Every acquisition writes a
        # new key (the wait queue), so history is compacted after 5 minutes or
        # the revision log grows without bound over long test/bench runs.
        # setsid + nohup detach it from
        # this script's session/process group so it outlives the script (and a CI
        # runner killing our process group).
        setsid nohup /usr/bin/etcd \
            --name fenced-ci \
            --data-dir "$ETCD_DATA_DIR" \
            --listen-client-urls http://127.0.0.1:2379 \
            --advertise-client-urls http://127.0.0.1:2379 \
            --listen-peer-urls http://127.0.0.1:2380 \
            --initial-advertise-peer-urls http://127.0.0.1:2380 \
            --initial-cluster fenced-ci=http://127.0.0.1:2380 \
            --auto-compaction-mode periodic \
            --auto-compaction-retention 5m \
            --logger zap \
            >>"$ETCD_LOG" 2>&1 </dev/null &
        pid=$!
        wait_for etcd etcd_answers "$ETCD_LOG" "$pid"
        did+=("started (pid $pid), healthy after ${WAITED}s")
    fi
    report etcd "${did[@]}"
}

# --- ZooKeeper -------------------------------------------------------------

setup_zookeeper() {
    local did=() pid
    if zookeeper_answers; then
        report zookeeper "already running"
        return
    fi
    if [ ! -r /usr/share/java/zookeeper.jar ] || ! have java; then
        apt_install zookeeper   # brings a JRE (default-jre)
        did+=("installed zookeeper")
    fi
    mkdir -p "$ZK_DIR/data" "$(dirname "$ZK_LOG")"
    # Standalone on loopback. tickTime 1 s lets clients negotiate sessions
    # from 2 s (the tests' short TTLs) up to 60 s; the admin HTTP server is
    # off (it would take port 8080); `srvr`/`ruok`/`mntr`/`stat` answer
    # probes.
    cat >"$ZK_DIR/zoo.cfg" <<CFG
tickTime=1000
initLimit=10
syncLimit=5
dataDir=$ZK_DIR/data
clientPort=2181
clientPortAddress=127.0.0.1
minSessionTimeout=2000
maxSessionTimeout=60000
4lw.commands.whitelist=srvr,ruok,mntr,stat
admin.enableServer=false
CFG
    # Started directly (no systemd); setsid + nohup detach it from this
    # script's process group, as for etcd.
    setsid nohup java -Xms64m -Xmx256m \
        -cp /etc/zookeeper/conf:/usr/share/java/zookeeper.jar \
        -Dzookeeper.log.dir=/var/log/zookeeper \
        org.apache.zookeeper.server.quorum.QuorumPeerMain "$ZK_DIR/zoo.cfg" \
        >>"$ZK_LOG" 2>&1 </dev/null &
    pid=$!
    wait_for zookeeper zookeeper_answers "$ZK_LOG" "$pid"
    did+=("started (pid $pid), serving after ${WAITED}s")
    report zookeeper "${did[@]}"
}

# --- PostgreSQL ------------------------------------------------------------

# The newest server binaries Debian's packages installed
# (/usr/lib/postgresql/<major>/bin), or nothing.
pg_bindir() {
    local dir
    dir=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
    [ -n "$dir" ] && [ -x "$dir/postgres" ] && printf '%s\n' "$dir"
}

# PostgreSQL accepts TCP connections while it is still starting up (and
# refuses logins then), so once the client tools exist ask pg_isready, which
# succeeds only when the server accepts connections.
postgres_answers() {
    if have pg_isready; then
        pg_isready -q -h 127.0.0.1 -p "$PG_PORT" -t 3
    else
        port_open "$PG_PORT"
    fi
}

# psql as role postgres over TCP, the way the tests connect; -w: never wait
# for a password prompt.
pg_tcp() {
    PGCONNECT_TIMEOUT=5 psql -X -q -w -At -v ON_ERROR_STOP=1 \
        -h 127.0.0.1 -p "$PG_PORT" -U postgres "$@"
}

# psql as the postgres OS user over the unix socket (peer authentication in
# Debian's stock pg_hba.conf), for fixing access when TCP logins fail. From
# / so that psql does not complain about a working directory it cannot read.
pg_local() {
    (cd / && runuser -u postgres -- psql -X -q -w -At -v ON_ERROR_STOP=1 -p "$PG_PORT" "$@")
}

postgres_tcp_ok() {
    # Retried: a server that just started may refuse for a moment.
    local try
    for try in 1 2 3 4 5; do
        if pg_tcp -d postgres -c 'SELECT 1' >/dev/null 2>&1; then
            return 0
        fi
        sleep 1
    done
    return 1
}

# Put `host all all 127.0.0.1/32 trust` first in pg_hba.conf $1 (the first
# matching line decides; Debian's stock file asks for scram-sha-256 on
# 127.0.0.1). The file is rewritten in place so that its owner and mode stay.
postgres_trust_loopback() {
    local hba=$1 line='host    all    all    127.0.0.1/32    trust' tmp
    tmp=$(mktemp)
    {
        printf '# The fenced test suite (scripts/services.sh): role postgres over TCP from\n'
        printf '# 127.0.0.1 without a password; the server listens on 127.0.0.1 only.\n'
        printf '%s\n' "$line"
        cat "$hba"
    } >"$tmp"
    cat "$tmp" >"$hba"
    rm -f "$tmp"
}

postgres_ensure_access() {
    local hba exists
    if ! have psql; then
        apt_install postgresql-client
        have psql || die "installed postgresql-client, but there is still no \`psql\` command on PATH"
        did+=("installed postgresql-client for the access check")
    fi
    if ! postgres_tcp_ok; then
        [ "$(id -u)" = 0 ] || die "postgres: role postgres cannot log in over TCP on 127.0.0.1:$PG_PORT, and fixing pg_hba.conf needs root"
        hba=$(pg_local -d postgres -c 'SHOW hba_file') \
            || die "postgres: role postgres cannot log in over TCP, and the postgres OS user cannot connect over the unix socket to fix pg_hba.conf"
        postgres_trust_loopback "$hba"
        pg_local -d postgres -c 'SELECT pg_reload_conf()' >/dev/null \
            || die "postgres: could not reload the configuration after editing $hba"
        postgres_tcp_ok || die "postgres: role postgres still cannot log in over TCP after trusting 127.0.0.1/32 in $hba"
        did+=("trusted role postgres over 127.0.0.1/32 in $hba")
    fi
    exists=$(pg_tcp -d postgres -c "SELECT 1 FROM pg_database WHERE datname = '$PG_DATABASE'") \
        || die "postgres: could not list the databases"
    if [ "$exists" != 1 ]; then
        # A concurrent run may create it first; only a database still
        # missing afterwards is an error.
        pg_tcp -d postgres -c "CREATE DATABASE $PG_DATABASE" >/dev/null 2>&1 || true
        exists=$(pg_tcp -d postgres -c "SELECT 1 FROM pg_database WHERE datname = '$PG_DATABASE'")
        [ "$exists" = 1 ] || die "postgres: could not create database $PG_DATABASE"
        did+=("created database $PG_DATABASE")
    fi
    did+=("postgres@127.0.0.1 and database $PG_DATABASE OK")
}

# Restart the server that answers on $PG_PORT, the way it was started: a
# Debian cluster with pg_ctlcluster, our own data dir with pg_ctl. Fails
# (returns 1) for a server this script does not know how to restart.
postgres_restart() {
    local datadir ver name port status owner dir log
    datadir=$(pg_tcp -d postgres -c 'SHOW data_directory') || return 1
    if have pg_lsclusters; then
        while read -r ver name port status owner dir log; do
            if [ "$dir" = "$datadir" ]; then
                pg_ctlcluster "$ver" "$name" restart >>"$PG_LOG" 2>&1 || return 1
                return 0
            fi
        done < <(pg_lsclusters -h)
    fi
    if [ "$datadir" = "$PG_DATA_DIR" ]; then
        (cd / && runuser -u postgres -- "$(pg_bindir)/pg_ctl" -D "$PG_DATA_DIR" -l "$PG_LOG" \
            -s -w -t "$WAIT_SECS" -m fast restart) >>"$PG_LOG" 2>&1 || return 1
        return 0
    fi
    return 1
}

# Every advisory lock holds a connection, and the suites run many pools at
# once: the stock 100 is too few. A server this script started already has
# the higher limit from its configuration; on one it found running the
# limit is persisted with ALTER SYSTEM and needs a restart, done only when
# no other client is connected (a restart would cut off a running test).
postgres_raise_connection_limit() {
    local now others
    now=$(pg_tcp -d postgres -c 'SHOW max_connections') || die "postgres: could not read max_connections"
    if [ "$now" -ge "$PG_MIN_CONNECTIONS" ]; then
        did+=("max_connections $now")
        return
    fi
    pg_tcp -d postgres -c "ALTER SYSTEM SET max_connections = $PG_MAX_CONNECTIONS" >/dev/null \
        || die "postgres: ALTER SYSTEM SET max_connections failed"
    others=$(pg_tcp -d postgres -c "SELECT count(*) FROM pg_stat_activity
        WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()")
    if [ "$others" != 0 ]; then
        did+=("max_connections $now; $PG_MAX_CONNECTIONS set for the next restart (not restarted: $others other clients connected)")
        return
    fi
    if ! postgres_restart; then
        did+=("max_connections $now; $PG_MAX_CONNECTIONS set for the next restart (not restarted: not a server this script knows how to restart)")
        return
    fi
    wait_for postgres postgres_answers "$PG_LOG"
    now=$(pg_tcp -d postgres -c 'SHOW max_connections')
    did+=("restarted for max_connections $now")
}

# Our settings for a Debian cluster this script starts, in a conf.d file
# read after the others (later settings win; ALTER SYSTEM's still override).
postgres_configure_debian() {
    local conf=/etc/postgresql/$1/main
    if ! grep -Eq "^[[:space:]]*include_dir[[:space:]]*=?[[:space:]]*'conf\\.d'" "$conf/postgresql.conf"; then
        printf "include_dir = 'conf.d'\n" >>"$conf/postgresql.conf"
    fi
    install -d -o postgres -g postgres -m 0755 "$conf/conf.d"
    cat >"$conf/conf.d/95-fenced.conf" <<CONF
# Written by fenced's scripts/services.sh: the test suite's server.
listen_addresses = '127.0.0.1'
port = $PG_PORT
max_connections = $PG_MAX_CONNECTIONS
CONF
    chown postgres:postgres "$conf/conf.d/95-fenced.conf"
}

# Our own cluster in $PG_DATA_DIR (where Debian's packages made none):
# trust for local and 127.0.0.1 connections, as the Debian cluster of the
# test machines is set up.
postgres_configure_own() {
    local bindir=$1
    if [ ! -s "$PG_DATA_DIR/PG_VERSION" ]; then
        install -d -o postgres -g postgres -m 0700 "$PG_DATA_DIR"
        (cd / && runuser -u postgres -- "$bindir/initdb" -D "$PG_DATA_DIR" -U postgres \
            --auth=trust --encoding=UTF8) >>"$PG_LOG" 2>&1 \
            || { show_log "$PG_LOG"; die "initdb $PG_DATA_DIR failed"; }
        printf "include 'fenced.conf'\n" >>"$PG_DATA_DIR/postgresql.conf"
        did+=("initialised $PG_DATA_DIR")
    fi
    cat >"$PG_DATA_DIR/fenced.conf" <<CONF
# Written by fenced's scripts/services.sh: the test suite's server.
listen_addresses = '127.0.0.1'
port = $PG_PORT
max_connections = $PG_MAX_CONNECTIONS
CONF
    chown postgres:postgres "$PG_DATA_DIR/fenced.conf"
}

postgres_start() {
    local bindir=$1 major
    major=$(basename "$(dirname "$bindir")")
    [ "$(id -u)" = 0 ] || die "need root to start PostgreSQL"
    mkdir -p "$(dirname "$PG_LOG")"
    touch "$PG_LOG"
    chown postgres:postgres "$PG_LOG"
    # The default unix socket directory of Debian's builds; /run is a tmpfs.
    install -d -o postgres -g postgres -m 2775 /var/run/postgresql
    if have pg_ctlcluster && [ -r "/etc/postgresql/$major/main/postgresql.conf" ]; then
        postgres_configure_debian "$major"
        pg_ctlcluster "$major" main start >>"$PG_LOG" 2>&1 || {
            show_log "$PG_LOG"
            show_log "/var/log/postgresql/postgresql-$major-main.log"
            die "pg_ctlcluster $major main start failed"
        }
        wait_for postgres postgres_answers "/var/log/postgresql/postgresql-$major-main.log"
        did+=("started cluster $major/main (pg_ctlcluster), answering after ${WAITED}s")
    else
        postgres_configure_own "$bindir"
        # pg_ctl detaches the server (its own session) and returns once it
        # is started or has failed; wait_for then checks TCP logins.
        (cd / && runuser -u postgres -- "$bindir/pg_ctl" -D "$PG_DATA_DIR" -l "$PG_LOG" \
            -s -w -t "$WAIT_SECS" start) >>"$PG_LOG" 2>&1 \
            || { show_log "$PG_LOG"; die "pg_ctl start on $PG_DATA_DIR failed"; }
        wait_for postgres postgres_answers "$PG_LOG"
        did+=("started $PG_DATA_DIR (pg_ctl), answering after ${WAITED}s")
    fi
}

setup_postgres() {
    local did=() bindir
    if postgres_answers; then
        did+=("already running")
    else
        bindir=$(pg_bindir) || true
        if [ -z "$bindir" ] || ! have psql || ! have pg_isready; then
            # Brings postgresql-client and, through postgresql-common's
            # postinst, a cluster <major>/main (not started where policy-rc.d
            # forbids it).
            apt_install postgresql
            did+=("installed postgresql")
            bindir=$(pg_bindir) || die "installed postgresql, but found no server binaries under /usr/lib/postgresql"
        fi
        if postgres_answers; then
            did+=("started by the package")
        else
            postgres_start "$bindir"
        fi
    fi
    postgres_ensure_access
    postgres_raise_connection_limit
    report postgres "${did[@]}"
}

# --- protoc ----------------------------------------------------------------

setup_protoc() {
    if have protoc; then
        echo "protoc: already installed ($(protoc --version))"
    else
        apt_install protobuf-compiler
        echo "protoc: installed protobuf-compiler ($(protoc --version))"
    fi
}

# --- faketime (the fault suite's clock-skew scenario) -----------------------

setup_faketime() {
    if have faketime; then
        echo "faketime: already installed"
    else
        apt_install faketime
        echo "faketime: installed (libfaketime, for client processes with a skewed clock)"
    fi
}

setup_mariadb
setup_redis
setup_redis_cluster
setup_etcd
setup_zookeeper
setup_postgres
setup_protoc
setup_faketime
