# Busy loops for the load harness (sourced by under_load.sh and ci_under_load.sh): start_load N
# starts N processes spinning `while True: pass`; end_load ends every one started. The sourcing
# script ends them on exit and on Ctrl-C, whatever its result.
busy=()
start_load() {
    for _ in $(seq "$1"); do
        python3 -c 'while True: pass' &
        busy+=($!)
    done
}
end_load() {
    for pid in "${busy[@]}"; do
        kill "$pid" 2>/dev/null
    done
    busy=()
}
trap end_load EXIT
trap 'exit 130' INT TERM
