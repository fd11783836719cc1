# Shared by deploy/local-cluster.sh and deploy/netns-cluster.sh (sourced, not run).

# schedule_jobs: fills `jobs` with "DELAY SPEC" entries (DELAY: seconds after the previous
# submission): the specs of $job_list $spacing apart, or else the six example jobs. Returns
# 1 with the first spec that is not a file in `missing_spec`.
schedule_jobs() {
    local delay=0 spec
    jobs=()
    if [[ -n "$job_list" ]]; then
        for spec in $job_list; do
            [[ -f "$spec" ]] || { missing_spec=$spec; return 1; }
            jobs+=("$delay $spec")
            delay=$spacing
        done
    else
        jobs=(
            "0 examples/jobs/a9a-logreg.toml"
            "$spacing examples/jobs/optdigits-softmax.toml"
            "$spacing examples/jobs/millionsong-linreg.toml"
            "$spacing examples/jobs/mnist-mlp.toml"
            "$spacing examples/jobs/optdigits-mlp.toml"
            "$spacing examples/jobs/optdigits-ps.toml"
        )
    fi
}

# submit_jobs_in_background COMMAND...: in a background process, submits the `jobs` at their
# delays with `COMMAND... submit SPEC`, logging to $work/submit.log; sets `submitter`.
submit_jobs_in_background() {
    (
        local entry delay spec
        for entry in "${jobs[@]}"; do
            read -r delay spec <<<"$entry"
            sleep "$delay"
            "$@" submit "$spec" >>"$work/submit.log" 2>&1 || echo "submit $spec failed" >>"$work/submit.log"
        done
    ) &
    submitter=$!
}
