#!/usr/bin/env bash
# Writes the NATS server configuration of a secured Converge cluster: one account CONVERGE
# (JetStream enabled) with one user per role and the publish/subscribe allow lists of
# docs/security.md, and a password file per user.
#
#   deploy/nats/gen-config.sh --hosts node-1,node-2 --out /etc/converge/nats
#
# writes
#   OUT/nats-server.conf                 the server configuration (holds the passwords: 0640)
#   OUT/credentials/<user>.password      one password per user (0600): allocator, cli, viewer,
#                                        agent-<host> for every host (and admin with --admin)
#
# Start the server with `nats-server --config OUT/nats-server.conf` and each process with
#   --nats-user <user> --nats-password-file OUT/credentials/<user>.password
# (or CONVERGE_NATS_USER / CONVERGE_NATS_PASSWORD_FILE).
#
# An existing password file is kept, so running the script again with more hosts adds
# users without changing anyone's password, and a password you chose is used when you
# write it to the file first. To rotate a password, delete its file, run the script again
# and reload the server (`nats-server --signal reload`, or SIGHUP); see docs/security.md.
#
# Options:
#   --hosts H1,H2,...    agent host ids (required; letters, digits, '_' and '-')
#   --out DIR            output directory (required)
#   --store-dir DIR      JetStream store directory (default /data)
#   --listen HOST:PORT   client listener (default 0.0.0.0:4222)
#   --http HOST:PORT     monitoring listener (default: none)
#   --server-name NAME   server name (default converge-nats)
#   --admin              also write an `admin` user with every right in the account (for
#                        the `nats` CLI; keep its password off the cluster's hosts)
#   --max-store SIZE     JetStream file storage the account may use in all (default 16G, sizes
#                        in decimal units as NATS reads them: 16G = 16 x 10^9 bytes;
#                        Converge's streams reserve about 3.9 GiB per replica: the progress
#                        stream 2 GiB, the buckets 1.9 GiB; docs/deploy.md, "Storage").
#                        The server's own JetStream store is sized to the same figures
#                        (max_file_store, max_memory_store), so the configuration starts
#                        on any disk; keep SIZE below what the store directory's disk holds
#   --max-mem SIZE       JetStream memory storage the account may use (default 256M;
#                        Converge keeps everything on file)
#   --max-streams N      streams (buckets count as one each) the account may create
#                        (default 32; Converge makes 8)
#   --max-consumers N    consumers the account may hold at once (default 200 + 4 per host:
#                        each agent's plan watch, a re-created one for 30 s after a
#                        reconnect, the allocator's, dashboards' and `converge watch`es')
#   --max-connections N  client connections the account may hold at once (default 100 + 2
#                        per host: one per agent, allocator replica, dashboard, `converge`
#                        command, with room for reconnects that overlap the old connection)
#   --max-subscriptions N  subscriptions the account may hold at once (default 2000 + 20
#                        per host; an agent holds a few, the allocator a few dozen)
#   --tls-cert FILE      server certificate (PEM): clients must then use TLS
#   --tls-key FILE       its private key (PEM)
#   --tls-ca FILE        CA that signed client certificates (with --tls-verify)
#   --tls-verify         require a client certificate signed by --tls-ca
#
# A cluster of NATS servers (docs/deploy.md, "A replicated bus"): the same file on every
# server, each started with its own name (`nats-server --config ... --server_name n2`, or
# --server-name per server when you write one file each):
#   --cluster-name NAME  the cluster's name (same on every server); needs --routes
#   --routes URLS        every server's route URL, comma-separated, this one's included
#                        (nats://n1:6222,nats://n2:6222,nats://n3:6222); no credentials in
#                        them: the routes authenticate as user `route` with the password in
#                        OUT/credentials/route.password (generated, kept like the others)
#   --cluster-listen HOST:PORT   route listener (default 0.0.0.0:6222)
# With --tls-cert the routes use TLS too (mutual: each server presents its certificate
# and checks the others' against --tls-ca, which is then required; gen-tls.sh's server
# certificates are valid for both ends).
set -euo pipefail

usage() {
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//' >&2
    exit 2
}
die() {
    echo "gen-config.sh: $*" >&2
    exit 1
}

hosts="" out="" store_dir=/data listen=0.0.0.0:4222 http="" server_name=converge-nats
admin=0 tls_cert="" tls_key="" tls_ca="" tls_verify=0
cluster_name="" routes="" cluster_listen=0.0.0.0:6222
max_store=16G max_mem=256M max_streams=32 max_consumers="" max_connections="" max_subscriptions=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --hosts) hosts=${2:?--hosts needs a value}; shift 2 ;;
        --out) out=${2:?--out needs a value}; shift 2 ;;
        --store-dir) store_dir=${2:?--store-dir needs a value}; shift 2 ;;
        --listen) listen=${2:?--listen needs a value}; shift 2 ;;
        --http) http=${2:?--http needs a value}; shift 2 ;;
        --server-name) server_name=${2:?--server-name needs a value}; shift 2 ;;
        --admin) admin=1; shift ;;
        --tls-cert) tls_cert=${2:?--tls-cert needs a value}; shift 2 ;;
        --tls-key) tls_key=${2:?--tls-key needs a value}; shift 2 ;;
        --tls-ca) tls_ca=${2:?--tls-ca needs a value}; shift 2 ;;
        --tls-verify) tls_verify=1; shift ;;
        --cluster-name) cluster_name=${2:?--cluster-name needs a value}; shift 2 ;;
        --routes) routes=${2:?--routes needs a value}; shift 2 ;;
        --cluster-listen) cluster_listen=${2:?--cluster-listen needs a value}; shift 2 ;;
        --max-store) max_store=${2:?--max-store needs a value}; shift 2 ;;
        --max-mem) max_mem=${2:?--max-mem needs a value}; shift 2 ;;
        --max-streams) max_streams=${2:?--max-streams needs a value}; shift 2 ;;
        --max-consumers) max_consumers=${2:?--max-consumers needs a value}; shift 2 ;;
        --max-connections) max_connections=${2:?--max-connections needs a value}; shift 2 ;;
        --max-subscriptions) max_subscriptions=${2:?--max-subscriptions needs a value}; shift 2 ;;
        -h|--help) usage ;;
        *) echo "gen-config.sh: unknown option $1" >&2; usage ;;
    esac
done
[[ -n "$hosts" ]] || die "--hosts is required (comma-separated agent host ids)"
[[ -n "$out" ]] || die "--out is required"
if [[ -n "$tls_cert" || -n "$tls_key" ]]; then
    [[ -n "$tls_cert" && -n "$tls_key" ]] || die "--tls-cert and --tls-key go together"
    [[ -r "$tls_cert" ]] || die "cannot read --tls-cert $tls_cert"
    [[ -r "$tls_key" ]] || die "cannot read --tls-key $tls_key"
fi
if [[ $tls_verify == 1 ]]; then
    [[ -n "$tls_cert" && -n "$tls_ca" ]] || die "--tls-verify needs --tls-cert, --tls-key and --tls-ca"
fi
[[ -z "$tls_ca" || -r "$tls_ca" ]] || die "cannot read --tls-ca $tls_ca"
route_list=()
if [[ -n "$cluster_name" || -n "$routes" ]]; then
    [[ -n "$cluster_name" && -n "$routes" ]] || die "--cluster-name and --routes go together"
    [[ "$cluster_name" =~ ^[A-Za-z0-9_-]+$ ]] || die "invalid --cluster-name '$cluster_name' (letters, digits, '_' and '-')"
    IFS=',' read -r -a route_list <<<"$routes"
    for r in "${route_list[@]}"; do
        [[ "$r" =~ ^(nats|tls)://[A-Za-z0-9._-]+:[0-9]+$ ]] \
            || die "invalid route '$r' in --routes (nats://host:port, no credentials: they are added)"
    done
    [[ -z "$tls_cert" || -n "$tls_ca" ]] \
        || die "routes over TLS need --tls-ca (the CA that signed every server's certificate)"
fi
for v in "$max_store" "$max_mem"; do
    [[ "$v" =~ ^[1-9][0-9]*[KMGT]?$ ]] || die "invalid size '$v' (a number of bytes, or with K, M, G or T: 16G)"
done
for v in "$max_streams" ${max_consumers:+"$max_consumers"} ${max_connections:+"$max_connections"} ${max_subscriptions:+"$max_subscriptions"}; do
    [[ "$v" =~ ^[1-9][0-9]*$ ]] || die "invalid count '$v' (a whole number above 0)"
done
# Quoted into the configuration below: no quotes or backslashes.
for v in "$store_dir" "$listen" "$http" "$server_name" "$tls_cert" "$tls_key" "$tls_ca" "$cluster_listen"; do
    [[ "$v" != *[\"\\]* ]] || die "no quotes or backslashes in paths and names: $v"
done

# Host ids as the protocol defines them (docs/protocol.md, "Ids"): one subject token each.
IFS=',' read -r -a host_list <<<"$hosts"
declare -A seen=()
for h in "${host_list[@]}"; do
    [[ "$h" =~ ^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$ ]] \
        || die "invalid host id '$h' (letters, digits, '_' and '-', at most 64, not starting with '_' or '-')"
    [[ -z "${seen[$h]:-}" ]] || die "host $h given twice"
    seen[$h]=1
done

# Names of protocol v1 (common/src/subjects.rs).
P=converge.v1
B_JOBS=converge-jobs B_STATUS=converge-job-status B_PLANS=converge-plans B_HOSTS=converge-hosts
B_LEADER=converge-leader
B_QUEUES=converge-queues B_QUEUE_STATUS=converge-queue-status
PROGRESS_STREAM=CONVERGE_PROGRESS
STREAMS=("KV_$B_JOBS" "KV_$B_STATUS" "KV_$B_PLANS" "KV_$B_HOSTS" "$PROGRESS_STREAM")
# Opened by the allocator and the CLI only: agents have no right on the queue buckets.
QUEUE_STREAMS=("KV_$B_QUEUES" "KV_$B_QUEUE_STATUS")

mkdir -p "$out"
umask 077
mkdir -p "$out/credentials"
chmod 700 "$out/credentials"

# The password of $1: its file if it exists, else 48 random hex digits written to it.
password() {
    local file="$out/credentials/$1.password" pw
    if [[ -f "$file" ]]; then
        IFS= read -r pw <"$file" || true
        [[ -n "$pw" ]] || die "$file is empty: delete it to generate a new password"
        [[ "$pw" =~ ^[[:print:]]+$ && "$pw" != *[\"\\]* ]] \
            || die "$file: a password must be printable, without quotes or backslashes"
    else
        pw=$(od -An -tx1 -N24 /dev/urandom | tr -d ' \n')
        [[ ${#pw} -eq 48 ]] || die "cannot read /dev/urandom"
        printf '%s\n' "$pw" >"$file"
    fi
    chmod 600 "$file"
    printf '%s' "$pw"
}

# Writes one user entry: $1 user, $2 password, $3 publish allow list, $4 subscribe allow
# list (newline-separated subjects).
user_entry() {
    local user=$1 pw=$2 pub=$3 sub=$4 s
    printf '      {\n        user: "%s"\n        password: "%s"\n' "$user" "$pw"
    printf '        permissions: {\n          publish: { allow: [\n'
    while IFS= read -r s; do [[ -n "$s" ]] && printf '            "%s"\n' "$s"; done <<<"$pub"
    printf '          ] }\n          subscribe: { allow: [\n'
    while IFS= read -r s; do [[ -n "$s" ]] && printf '            "%s"\n' "$s"; done <<<"$sub"
    printf '          ] }\n        }\n      }\n'
}

stream_info() {
    local s
    echo '$JS.API.INFO'
    for s in "${STREAMS[@]}"; do echo "\$JS.API.STREAM.INFO.$s"; done
}

# allocator (every replica): owns the buckets and the stream (creates and updates them,
# reads everything through the JetStream API), writes plans, job statuses, queue statuses
# and the leader lease, publishes events. It reads queues, never writes them.
allocator_pub=$(cat <<EOF
\$JS.API.>
\$JS.FC.>
\$KV.$B_PLANS.>
\$KV.$B_STATUS.>
\$KV.$B_QUEUE_STATUS.>
\$KV.$B_LEADER.>
$P.events.>
EOF
)
allocator_sub="_INBOX.allocator.>"

# cli: writes job specs and queues (converge queue create|set|delete); reads specs,
# statuses, hosts, queues and queue statuses; follows events, telemetry and the progress
# stream (converge dashboard). It cannot write a queue status.
cli_pub=$(
    stream_info
    for s in "${QUEUE_STREAMS[@]}"; do echo "\$JS.API.STREAM.INFO.$s"; done
    for b in $B_JOBS $B_STATUS $B_HOSTS $B_QUEUES $B_QUEUE_STATUS; do
        echo "\$JS.API.DIRECT.GET.KV_$b.>"
        echo "\$JS.API.DIRECT.GET.KV_$b"
        echo "\$JS.API.CONSUMER.CREATE.KV_$b"
        echo "\$JS.API.CONSUMER.CREATE.KV_$b.>"
        echo "\$JS.API.CONSUMER.INFO.KV_$b.*"
        echo "\$JS.API.CONSUMER.DELETE.KV_$b.*"
        echo "\$JS.FC.KV_$b.>"
    done
    echo "\$KV.$B_JOBS.*"
    echo "\$KV.$B_QUEUES.*"
    # The progress stream, read only (converge dashboard's loss curves).
    echo "\$JS.API.CONSUMER.CREATE.$PROGRESS_STREAM"
    echo "\$JS.API.CONSUMER.CREATE.$PROGRESS_STREAM.>"
    echo "\$JS.API.CONSUMER.INFO.$PROGRESS_STREAM.*"
    echo "\$JS.API.CONSUMER.DELETE.$PROGRESS_STREAM.*"
    echo "\$JS.FC.$PROGRESS_STREAM.>"
)
cli_sub=$(printf '%s\n' "_INBOX.cli.>" "$P.events.>" "$P.telemetry.*")

# viewer: what `converge dashboard`, `converge watch` and the read-only CLI commands need
# (jobs, hosts, queue list, monitor): the cli user's reads without its two writes (job
# specs and queues). A dashboard that serves a browser holds no right to change the cluster.
viewer_pub=$(grep -v -e '^\$KV\.' <<<"$cli_pub")
viewer_sub=$(printf '%s\n' "_INBOX.viewer.>" "$P.events.>" "$P.telemetry.*")

# agent-<host>: its own heartbeat, telemetry and host events; progress of any job on its
# own host's subjects only (converge.v1.progress.<job>.<host>: the allocator refuses
# reports of jobs not placed on the host); events of any job (see docs/security.md);
# reads and watches its own plan only.
agent_pub() {
    local h=$1
    stream_info
    cat <<EOF
\$JS.API.DIRECT.GET.KV_$B_PLANS.\$KV.$B_PLANS.$h
\$JS.API.CONSUMER.CREATE.KV_$B_PLANS.*.\$KV.$B_PLANS.$h
\$JS.FC.KV_$B_PLANS.>
\$KV.$B_HOSTS.$h
$P.telemetry.$h
$P.events.host.$h
$P.events.job.*
$P.progress.*.$h
EOF
}

# Passwords first: a bad password file stops the script before anything is written.
declare -A pw=()
users=(allocator cli viewer)
for h in "${host_list[@]}"; do users+=("agent-$h"); done
[[ $admin == 0 ]] || users+=(admin)
for u in "${users[@]}"; do pw[$u]=$(password "$u"); done
# The routes' own user (cluster authorization), not an account user.
if [[ ${#route_list[@]} -gt 0 ]]; then
    pw[route]=$(password route)
    [[ "${pw[route]}" =~ ^[A-Za-z0-9._~-]+$ ]] \
        || die "$out/credentials/route.password: the route password goes into URLs: letters, digits and ._~- only"
fi

conf="$out/nats-server.conf"
tmp="$conf.tmp.$$"
trap 'rm -f "$tmp"' EXIT
{
    echo "# NATS server of a secured Converge cluster, written by deploy/nats/gen-config.sh"
    echo "# for hosts: ${host_list[*]}. Holds passwords: keep it readable by the server only."
    echo "# Roles and permissions: docs/security.md."
    echo
    echo "server_name: \"$server_name\""
    echo "listen: \"$listen\""
    [[ -z "$http" ]] || echo "http: \"$http\""
    echo
    echo "jetstream {"
    echo "  store_dir: \"$store_dir\""
    echo "  # Sized to the account's limits below, not to 75 % of whatever disk the server"
    echo "  # finds: a server whose disk is smaller than the account limit would refuse to start."
    echo "  max_file_store: $max_store"
    echo "  max_memory_store: $max_mem"
    echo "}"
    if [[ -n "$tls_cert" ]]; then
        echo
        echo "tls {"
        echo "  cert_file: \"$tls_cert\""
        echo "  key_file: \"$tls_key\""
        [[ -z "$tls_ca" ]] || echo "  ca_file: \"$tls_ca\""
        [[ $tls_verify == 0 ]] || echo "  verify: true"
        echo "  timeout: 2"
        echo "}"
    fi
    if [[ ${#route_list[@]} -gt 0 ]]; then
        echo
        echo "# Routes between the cluster's servers: every server listens on $cluster_listen and"
        echo "# dials every route (its own is recognized and skipped)."
        echo "cluster {"
        echo "  name: \"$cluster_name\""
        echo "  listen: \"$cluster_listen\""
        echo "  authorization {"
        echo "    user: \"route\""
        echo "    password: \"${pw[route]}\""
        echo "    timeout: 2"
        echo "  }"
        echo "  routes: ["
        for r in "${route_list[@]}"; do echo "    \"${r%%://*}://route:${pw[route]}@${r#*://}\""; done
        echo "  ]"
        if [[ -n "$tls_cert" ]]; then
            echo "  tls {"
            echo "    cert_file: \"$tls_cert\""
            echo "    key_file: \"$tls_key\""
            echo "    ca_file: \"$tls_ca\""
            echo "    verify: true"
            echo "    timeout: 2"
            echo "  }"
        fi
        echo "}"
    fi
    echo
    echo "accounts {"
    echo "  CONVERGE {"
    echo "    # What the whole account may hold: a client that floods or opens consumers"
    echo "    # without end is refused at these limits instead of filling the server."
    echo "    jetstream {"
    echo "      max_file: $max_store"
    echo "      max_mem: $max_mem"
    echo "      max_streams: $max_streams"
    echo "      max_consumers: ${max_consumers:-$((200 + 4 * ${#host_list[@]}))}"
    echo "    }"
    echo "    # Connections and subscriptions: a client that opens them without end is refused"
    echo "    # at these (NATS has no per-user limits in a configuration file's accounts)."
    echo "    limits {"
    echo "      max_connections: ${max_connections:-$((100 + 2 * ${#host_list[@]}))}"
    echo "      max_subscriptions: ${max_subscriptions:-$((2000 + 20 * ${#host_list[@]}))}"
    echo "    }"
    echo "    users: ["
    user_entry allocator "${pw[allocator]}" "$allocator_pub" "$allocator_sub"
    user_entry cli "${pw[cli]}" "$cli_pub" "$cli_sub"
    user_entry viewer "${pw[viewer]}" "$viewer_pub" "$viewer_sub"
    for h in "${host_list[@]}"; do
        user_entry "agent-$h" "${pw[agent-$h]}" "$(agent_pub "$h")" "_INBOX.agent-$h.>"
    done
    if [[ $admin == 1 ]]; then
        printf '      { user: "admin", password: "%s" }\n' "${pw[admin]}"
    fi
    echo "    ]"
    echo "  }"
    echo "}"
} >"$tmp"
chmod 640 "$tmp"
mv "$tmp" "$conf"
trap - EXIT
echo "wrote $conf for users ${users[*]}${routes:+ and cluster $cluster_name (routes: $routes)}; passwords in $out/credentials/" >&2
