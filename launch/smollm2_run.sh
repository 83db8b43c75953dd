# Sourced by launch/smollm2_runs.sh and launch/smollm2_campaign.sh: run NAME FLAGS... runs the SmolLM2 job into
# "$out/NAME", appending to "$out/NAME.log", and retries it (up to $retries times, $pause seconds apart) from its
# newest checkpoint after a failure such as an out-of-memory kill. Needs $out, $retries, $pause, $port.
run() {  # name, then the job's flags
  local name="$1"; shift
  for attempt in $(seq 1 "$retries"); do
    if MASTER_PORT="$port" bash launch/main.sh --model smollm2-135m-instruct --task addition \
        --out "$out" --name "$name" "$@" >> "$out/$name.log" 2>&1; then
      echo "$(date -u +%FT%TZ) $name finished" >> "$out/runs.log"
      return 0
    fi
    echo "$(date -u +%FT%TZ) $name stopped (attempt $attempt); resuming from its checkpoint" >> "$out/runs.log"
    sleep "$pause"
  done
  return 1
}
