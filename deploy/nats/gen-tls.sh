#!/usr/bin/env bash
# Writes a test certificate authority, a server certificate signed by it and, optionally,
# client certificates, with openssl: enough to run a Converge cluster's NATS over TLS
# (docs/security.md, "TLS"). For production use your organization's CA instead.
#
#   deploy/nats/gen-tls.sh --out /etc/converge/nats/tls --names nats.example,localhost \
#       --ips 10.0.0.5,127.0.0.1 [--clients allocator,cli,agent-node-1]
#
# writes
#   OUT/ca.pem, OUT/ca-key.pem               the CA (keep ca-key.pem offline)
#   OUT/server.pem, OUT/server-key.pem       the server's certificate for --names and --ips
#   OUT/clients/<name>.pem, <name>-key.pem   client certificates (with --clients)
#
# then
#   deploy/nats/gen-config.sh ... --tls-cert OUT/server.pem --tls-key OUT/server-key.pem \
#       [--tls-ca OUT/ca.pem --tls-verify]
#   converge-agent ... --nats-tls-ca OUT/ca.pem \
#       [--nats-tls-cert OUT/clients/agent-node-1.pem --nats-tls-key OUT/clients/agent-node-1-key.pem]
#
# Options:
#   --out DIR        output directory (required)
#   --names N1,...   DNS names of the server (default localhost)
#   --ips A1,...     IP addresses of the server (default 127.0.0.1)
#   --clients C1,... names of client certificates to write (default none)
#   --days N         validity in days (default 825)
# An existing CA in OUT is reused, so clients can be added later.
set -euo pipefail

usage() {
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//' >&2
    exit 2
}
die() {
    echo "gen-tls.sh: $*" >&2
    exit 1
}

out="" names=localhost ips=127.0.0.1 clients="" days=825
while [[ $# -gt 0 ]]; do
    case "$1" in
        --out) out=${2:?--out needs a value}; shift 2 ;;
        --names) names=${2?--names needs a value}; shift 2 ;;
        --ips) ips=${2?--ips needs a value}; shift 2 ;;
        --clients) clients=${2:?--clients needs a value}; shift 2 ;;
        --days) days=${2:?--days needs a value}; shift 2 ;;
        -h|--help) usage ;;
        *) echo "gen-tls.sh: unknown option $1" >&2; usage ;;
    esac
done
[[ -n "$out" ]] || die "--out is required"
command -v openssl >/dev/null || die "openssl is required"
[[ -n "$names$ips" ]] || die "give the server at least one --names or --ips entry"

mkdir -p "$out/clients"
cd "$out"
umask 077
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

newkey() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

if [[ ! -f ca.pem || ! -f ca-key.pem ]]; then
    newkey ca-key.pem
    openssl req -x509 -new -key ca-key.pem -sha256 -days "$days" -subj "/CN=Converge test CA" \
        -addext "basicConstraints=critical,CA:TRUE" \
        -addext "keyUsage=critical,keyCertSign,cRLSign" -out ca.pem
fi

# Signs $2 (a key) for subject CN=$1 with extensions file $3 into $4.
sign() {
    openssl req -new -key "$2" -subj "/CN=$1" -out "$tmp/req.csr"
    openssl x509 -req -in "$tmp/req.csr" -CA ca.pem -CAkey ca-key.pem -CAcreateserial \
        -CAserial "$tmp/ca.srl" -days "$days" -sha256 -extfile "$3" -out "$4" 2>/dev/null
}

san=()
IFS=',' read -r -a name_list <<<"$names"
IFS=',' read -r -a ip_list <<<"$ips"
for n in "${name_list[@]}"; do [[ -z "$n" ]] || san+=("DNS:$n"); done
for a in "${ip_list[@]}"; do [[ -z "$a" ]] || san+=("IP:$a"); done
{
    echo "basicConstraints=critical,CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    # clientAuth too: in a cluster, a server dialing a route presents this certificate
    # to the other servers, which verify it (gen-config.sh --routes with --tls-cert).
    echo "extendedKeyUsage=serverAuth,clientAuth"
    echo "subjectAltName=$(IFS=,; echo "${san[*]}")"
} >"$tmp/server.ext"
newkey server-key.pem
sign "${name_list[0]:-${ip_list[0]}}" server-key.pem "$tmp/server.ext" server.pem

if [[ -n "$clients" ]]; then
    IFS=',' read -r -a client_list <<<"$clients"
    {
        echo "basicConstraints=critical,CA:FALSE"
        echo "keyUsage=critical,digitalSignature"
        echo "extendedKeyUsage=clientAuth"
    } >"$tmp/client.ext"
    for c in "${client_list[@]}"; do
        [[ "$c" =~ ^[A-Za-z0-9][A-Za-z0-9_.-]*$ ]] || die "invalid client name '$c'"
        newkey "clients/$c-key.pem"
        sign "$c" "clients/$c-key.pem" "$tmp/client.ext" "clients/$c.pem"
    done
fi
chmod 644 ca.pem server.pem
chmod 600 ca-key.pem server-key.pem
echo "wrote $out: ca.pem, server.pem (${san[*]})${clients:+, client certificates for $clients}" >&2
