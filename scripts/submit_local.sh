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
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
export PATH="$REPO/.venv/bin:$PATH"
export RAY_AUTH_MODE=token
RAY_PORT=${RAY_PORT:-6399}
DASH_PORT=${DASH_PORT:-8299}
OUT=${OUT:-$REPO/out/submit_local}
MODEL=${MODEL:-$REPO/models/specee-tiny}
ARGS=${ARGS:---limit 8 --waves 2 --max-new-tokens 8 --mode dense}
TMP=$(mktemp -d /tmp/specee-ray.XXXXXX)

[ -s ~/.ray/auth_token ] || ray get-auth-token --generate >/dev/null

ray start --head --block --num-cpus 2 --port "$RAY_PORT" --dashboard-port "$DASH_PORT" \
    --temp-dir "$TMP" --disable-usage-stats >"$TMP/head.log" 2>&1 &
HEAD=$!
stop_head() {
    kill "$HEAD" 2>/dev/null || true  # --block: the head stops the processes it started
    wait "$HEAD" 2>/dev/null || true
}
trap stop_head EXIT

ADDR="http://127.0.0.1:$DASH_PORT"
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
ray job status --address "$ADDR" "$JOB" >"$TMP/status.log" 2>&1
grep -q "Job '$JOB' succeeded" "$TMP/status.log" || { cat "$TMP/status.log"; echo "logs: $TMP"; exit 1; }
python -c "import json, sys; s = json.load(open(sys.argv[1])); print('summary:', s['rows'], 'rows,', s['errors'], 'errors')" \
    "$OUT/summary.json"
stop_head
rm -rf "$TMP"  # kept when anything above failed
