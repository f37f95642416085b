# Sourced by scripts/test.sh (issue 17): a throwaway PostgreSQL for the
# tests that run against the PostgreSQL store. Data dir target/pg/data,
# socket dir target/pg/sock (a /tmp dir when the `postgres` user cannot
# reach target/), TCP on 127.0.0.1:${BMX_PG_PORT:-25432} only (the next
# free port of the four after it when taken),
# trust auth for local connections of this machine, TLS on with a throwaway
# CA. Exports BMX_TEST_PG, BMX_TEST_PG_CA and BMX_TEST_PG_OTHER_CA;
# pg_stop (installed as an EXIT trap by pg_start) stops it. fsync is off
# (tests need no durability across a power cut) unless BMX_PG_FSYNC=on
# (scripts/bench-harness.sh: figures against a durable database).
#
# initdb refuses to run as root, so the cluster belongs to `postgres`
# (runuser) when we are root. Without binaries, Debian's `postgresql` is
# installed.

pg_bin=""
pg_root=""
pg_tmp=""

pg_find() {
  local d
  for d in /usr/lib/postgresql/*/bin; do
    if [ -x "$d/initdb" ] && [ -x "$d/pg_ctl" ]; then pg_bin=$d; fi
  done
  if [ -z "$pg_bin" ] && command -v pg_ctl >/dev/null 2>&1 && command -v initdb >/dev/null 2>&1; then
    pg_bin=$(dirname "$(command -v pg_ctl)")
  fi
}

pg_as() {
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

pg_stop() {
  local root=${pg_root:-$PWD/target/pg}
  if [ -n "${pg_bin:-}" ] && [ -f "$root/data/postmaster.pid" ]; then
    pg_as "$pg_bin/pg_ctl" -D "$root/data" -m fast -w -t 60 stop >/dev/null 2>&1 || true
  fi
  if [ -n "${pg_tmp:-}" ]; then rm -rf "$pg_tmp"; fi
}

# A CA, a server certificate signed by it for DNS:localhost, and an
# unrelated CA, under $1 (server key readable by the cluster's owner only).
pg_tls() {
  local d=$1
  command -v openssl >/dev/null 2>&1 || return 1
  mkdir -p "$d"
  (
    set -e
    cd "$d"
    for ca in ca other-ca; do
      openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
        -keyout "$ca.key" -out "$ca.crt" -days 3 -subj "/CN=bmx test $ca" \
        -addext "basicConstraints=critical,CA:TRUE" \
        -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
    done
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
      -keyout server.key -out server.csr -subj "/CN=localhost" 2>/dev/null
    printf 'subjectAltName=DNS:localhost\nbasicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n' >server.ext
    openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial \
      -out server.crt -days 3 -extfile server.ext 2>/dev/null
    chmod 0600 server.key
    chmod 0644 ca.crt other-ca.crt server.crt
  ) || return 1
  if [ "$(id -u)" = 0 ]; then chown postgres: "$d/server.key" "$d/server.crt"; fi
}

pg_start() {
  pg_find
  if [ -z "$pg_bin" ]; then
    if [ "$(id -u)" = 0 ]; then
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql
    else
      sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql
    fi
    pg_find
  fi
  if [ -z "$pg_bin" ]; then
    echo "scripts/pg.sh: no PostgreSQL binaries; PostgreSQL tests will skip (fail under CI)" >&2
    return 0
  fi
  # Below the usual ephemeral range (32768-60999), so no client socket of
  # this machine holds it by chance.
  local port=${BMX_PG_PORT:-25432}
  pg_root=$PWD/target/pg
  # A cluster left by a run that was killed: stop it and start afresh.
  pg_stop
  rm -rf "$pg_root"
  mkdir -p "$pg_root/data" "$pg_root/sock"
  if [ "$(id -u)" = 0 ]; then
    chown -R postgres: "$pg_root"
    # The checkout may sit where `postgres` cannot reach (under /root):
    # then the cluster goes to a private temporary dir instead.
    if ! runuser -u postgres -- test -w "$pg_root/data"; then
      rm -rf "$pg_root"
      pg_tmp=$(mktemp -d /tmp/bmx-pg.XXXXXX)
      pg_root=$pg_tmp
      mkdir -p "$pg_root/data" "$pg_root/sock"
      chown -R postgres: "$pg_root"
    fi
  fi
  chmod 0700 "$pg_root/data"
  local root=$pg_root
  pg_as "$pg_bin/initdb" -D "$root/data" -U postgres -A trust -E UTF8 --no-sync >"$root/initdb.log" 2>&1 ||
    { cat "$root/initdb.log" >&2; return 1; }
  trap pg_stop EXIT
  # TLS (docs/store.md, "TLS"): a throwaway CA and a server certificate
  # for `localhost` only (no IP address), so tests can tell verify-ca
  # (127.0.0.1 passes) from verify-full (only `localhost` passes); a second
  # CA that signed nothing, for the wrong-roots case.
  local ssl_opts=""
  if pg_tls "$root/tls"; then
    ssl_opts="-c ssl=on -c ssl_cert_file=$root/tls/server.crt -c ssl_key_file=$root/tls/server.key"
    export BMX_TEST_PG_CA="$root/tls/ca.crt" BMX_TEST_PG_OTHER_CA="$root/tls/other-ca.crt"
  else
    echo "scripts/pg.sh: no openssl; the server runs without TLS and TLS tests skip (fail under CI)" >&2
  fi
  # The port may be taken (a listener, or a client socket that happened to
  # get it as its ephemeral port): try the next ones before giving up.
  local tries=0
  until pg_as "$pg_bin/pg_ctl" -D "$root/data" -l "$root/log" -w -t 60 \
    -o "-p $port -k $root/sock -c listen_addresses=127.0.0.1 -c fsync=${BMX_PG_FSYNC:-off} -c max_connections=200 $ssl_opts" start >/dev/null; do
    tries=$((tries + 1))
    if [ "$tries" -ge 5 ]; then cat "$root/log" >&2; return 1; fi
    echo "scripts/pg.sh: port $port is taken, trying $((port + 1))" >&2
    port=$((port + 1))
  done
  # Tests create a database each from this one.
  export BMX_TEST_PG="postgres://postgres@127.0.0.1:$port/postgres"
  echo "scripts/pg.sh: PostgreSQL on 127.0.0.1:$port (BMX_TEST_PG)" >&2
}
