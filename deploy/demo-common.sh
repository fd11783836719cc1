# Shared by deploy/batch-demo.sh and deploy/sweep-demo.sh (sourced, not run).

# demo_args SCRIPT OPTION VAR ARGS...: parses a demo's options into the caller's globals:
# --debug (appended to `extra`), --out DIR (`out`, default a new temporary directory, made
# and resolved), --duration SECONDS (`duration`), --OPTION VALUE (the variable named VAR)
# and -h/--help (prints the script's header: its comment lines after the first). Set the
# defaults of `duration` and VAR before.
demo_args() {
    local script="$1" option="$2" var="$3"
    shift 3
    out=""
    extra=()
    while [[ $# -gt 0 ]]; do
        case "$1" in
            --debug) extra+=(--debug); shift ;;
            --out) out="$2"; shift 2 ;;
            --duration) duration="$2"; shift 2 ;;
            "--$option") printf -v "$var" '%s' "$2"; shift 2 ;;
            -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
            *) echo "$script: unknown option $1 (see --help)" >&2; exit 2 ;;
        esac
    done
    [[ -n "$out" ]] || out=$(mktemp -d -t "converge-${script%.sh}.XXXXXX")
    mkdir -p "$out"
    out=$(realpath "$out")
}

# demo_run_cluster NAME ARGS...: one run of deploy/local-cluster.sh with ARGS, the caller's
# `extra` and --duration, its summary in $out/NAME.json and its log in $out/NAME.log;
# prints the monitor's last line (or the log's tail). A failed run is not fatal.
demo_run_cluster() {
    local name="$1"
    shift
    "$root/deploy/local-cluster.sh" "${extra[@]}" --duration "$duration" \
        --summary "$out/$name.json" "$@" >"$out/$name.log" 2>&1 || true
    grep "^converge monitor: " "$out/$name.log" | tail -n 1 || tail -n 3 "$out/$name.log"
}
