#!/usr/bin/env bash
# Run jobs.generate the way a cluster runs it: start a private local Ray head (token auth on),
# submit the job with `ray job submit --working-dir .`, wait for it, stop the head.
#
#   scripts/submit_local.sh                       # 8 sample prompts, dense, tiny model
#   OUT=/abs/out ARGS="--limit 32 --mode dense" scripts/submit_local.sh
#
# Token auth: `ray start --head` (Ray >= 2.60) uses the token in ~/.ray/auth_token (created by
# `ray get-auth-token --generate`, or by the first local ray.init()); the CLI presents it when
# RAY_AUTH_MODE=token. The head gets its own ports and temp dir, so it neither meets nor stops
# any other Ray instance on this machine; only the processes it started are stopped at the end.
# It listens on 127.0.0.1 only: RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 makes Ray use the loopback address
# as the node's (pipeline/local_ray.py says why --node-ip-address 127.0.0.1 alone does not).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
export PATH="$REPO/.venv/bin:$PATH"
export RAY_AUTH_MODE=token
RAY_PORT=${RAY_PORT:-6399}
DASH_PORT=${DASH_PORT:-8299}
OUT=${OUT:-$REPO/out/submit_local}
MODEL=${MODEL:-$REPO/models/specee-tiny}
ARGS=${ARGS:---limit 8 --max-new-tokens 8 --mode dense}
TMP=$(mktemp -d /tmp/specee-ray.XXXXXX)

[ -s ~/.ray/auth_token ] || ray get-auth-token --generate >/dev/null

RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 ray start --head --block --num-cpus 2 --port "$RAY_PORT" \
    --dashboard-host 127.0.0.1 --dashboard-port "$DASH_PORT" --temp-dir "$TMP" --disable-usage-stats \
    >"$TMP/head.log" 2>&1 &
HEAD=$!
stop_head() {
    kill "$HEAD" 2>/dev/null || true  # --block: the head stops the processes it started
    wait "$HEAD" 2>/dev/null || true
}
trap stop_head EXIT

ADDR="http://127.0.0.1:$DASH_PORT"
# every listening socket of the head's processes must be on loopback
check_loopback() {
    local pids open
    pids=$(pgrep -d, -f "$TMP" || true)
    [ -n "$pids" ] || return 0
    open=$(ss -ltnpH 2>/dev/null | grep -E "pid=(${pids//,/|})," | awk '{print $4}' | grep -vE '^(127\.0\.0\.1|\[::ffff:127\.0\.0\.1\]|\[::1\]):' || true)
    [ -z "$open" ] || { echo "the head listens beyond loopback: $open" >&2; exit 1; }
}
JOB=specee-generate-$(date +%s)
# The job runs in a copy of the working dir: the output path must be absolute. Submission is
# retried until the head's job agent is up (a fresh head answers "No available agent" at first).
for i in $(seq 60); do
    ray job submit --address "$ADDR" --submission-id "$JOB" --no-wait --working-dir . -- \
        python -m jobs.generate --output "$OUT" --model "$MODEL" --no-progress $ARGS >"$TMP/submit.log" 2>&1 && break
    [ "$i" = 60 ] && { cat "$TMP/submit.log"; echo "logs: $TMP"; exit 1; }
    sleep 2
done
if RAY_AUTH_MODE=disabled ray job list --address "$ADDR" >"$TMP/noauth.log" 2>&1; then
    echo "the job API answered a client without the token: auth is off" >&2; exit 1
fi
echo "without the token: $(grep -m1 -io 'unauthori[sz]ed[^.]*\|401[^.]*\|auth[^.]*' "$TMP/noauth.log")"
ray job logs --address "$ADDR" --follow "$JOB"
check_loopback
ray job status --address "$ADDR" "$JOB" >"$TMP/status.log" 2>&1
grep -q "Job '$JOB' succeeded" "$TMP/status.log" || { cat "$TMP/status.log"; echo "logs: $TMP"; exit 1; }
python -c "import json, sys; s = json.load(open(sys.argv[1])); print('summary:', s['rows'], 'rows,', s['errors'], 'errors')" \
    "$OUT/_summary.json"
stop_head
rm -rf "$TMP"  # kept when anything above failed
