# What the CLI test scripts share (sourced): pass/fail counting, a temporary folder, the
# check that a resumed run ends bit-identically (after a bad training row, too), and `refuse`, the check that bad input
# gets exactly one error line and exit status 2, at once. Needs $exe.
# shellcheck shell=bash
fails=0 passes=0
ok() { passes=$((passes + 1)); }
bad() { echo "FAIL: $*"; fails=$((fails + 1)); }

# make_tmp: a fresh folder in $tmp, removed when the script exits. Only this shell removes
# it: a child forked for a background run holds the trap until it execs, and one
# signalled before that would run it.
make_tmp() {
  tmp=$(mktemp -d)
  trap '[ "$BASHPID" = "$$" ] && rm -rf "$tmp"' EXIT
}

# The parameter hash in a run's output file.
hash_of() { grep '^parameters: hash' "$1" | awk '{print $3}'; }

# check_resume WHAT ARGS...: 20 steps of dptrain ARGS in one go, and 10 saved then resumed
# to 20, end with the same parameter hash (needs $tmp).
# shellcheck disable=SC2015  # `check && ok || bad`: ok never fails
check_resume() {
  local what=$1
  shift
  "$exe" "$@" --batch 30 --steps 20 --log-every 20 >"$tmp/full.out" 2>&1
  "$exe" "$@" --batch 30 --steps 10 --log-every 20 --save "$tmp/ck.safetensors" >/dev/null 2>&1
  "$exe" "$@" --batch 30 --steps 20 --log-every 20 --resume "$tmp/ck.safetensors" >"$tmp/resumed.out" 2>&1
  [ -n "$(hash_of "$tmp/full.out")" ] && [ "$(hash_of "$tmp/full.out")" = "$(hash_of "$tmp/resumed.out")" ] && ok ||
    bad "$what ($*) is not bit-identical: $(hash_of "$tmp/full.out") vs $(hash_of "$tmp/resumed.out")"
}

# check_data_fault ARGS...: a training shard is too large to scan before the first step, so
# a bad token there is met as its window is first gathered. The step that meets it is
# abandoned before its update, and in one process the steps before it are saved (once they
# were lost with the run): a GPT over a shard with token 64 (outside its vocabulary) in
# window 131, met at step 33 in the file's order, exits 2 with one line naming the token
# and the saved step 32; the shard mended, the run resumed ends as one run straight
# through (needs $tmp).
# shellcheck disable=SC2015
check_data_fault() {
  local shard=$tmp/lm_bad.bin ck=$tmp/lm_cut.safetensors rc
  write_lm_shard() {  # token 2100 is past the 4 KiB of tokens a checkpoint identifies the file by
    python3 - "$shard" "$1" <<'PY'
import struct, sys
tokens = [(i * 7) % 60 for i in range(3000)]
tokens[2100] = int(sys.argv[2])
with open(sys.argv[1], "wb") as f:
    f.write(struct.pack("<256i", 20240520, 1, len(tokens), *[0] * 253))
    f.write(struct.pack(f"<{len(tokens)}H", *tokens))
PY
  }
  local lm=(--model gpt:L1-H2-C32-T16-V64 --data "$shard" --batch 4 --steps 36 --no-shuffle --log-every 36 "$@")
  local want="dptrain: error: data file '$shard': token 2100 is 64, outside [0, 64): the model's vocabulary has 64 tokens; the run stopped at step 33, and '$ck' holds step 32"
  rm -f "$ck"
  write_lm_shard 64
  "$exe" "${lm[@]}" --save "$ck" >/dev/null 2>"$tmp/err"
  rc=$?
  [ $rc -eq 2 ] && [ "$(cat "$tmp/err")" = "$want" ] && ok || bad "a bad training token ($*): rc $rc: $(cat "$tmp/err")"
  write_lm_shard 0
  "$exe" "${lm[@]}" --resume "$ck" >"$tmp/lm_resumed" 2>&1
  "$exe" "${lm[@]}" >"$tmp/lm_straight" 2>&1
  grep -q "resumed from '$ck' at step 32" "$tmp/lm_resumed" && [ -n "$(hash_of "$tmp/lm_straight")" ] &&
    [ "$(hash_of "$tmp/lm_resumed")" = "$(hash_of "$tmp/lm_straight")" ] && ok ||
    bad "resumed after a bad training token ($*): $(hash_of "$tmp/lm_resumed") against $(hash_of "$tmp/lm_straight"): $(tail -2 "$tmp/lm_resumed")"
}

# refuse "EXPECTED" ARGS...: dptrain ARGS exits 2 within 10 s, with one line on stderr
# that contains EXPECTED (a fixed string). Leaves the output in ./out and ./err.
refuse() {
  local want=$1
  shift
  timeout 10 "$exe" "$@" >out 2>err
  local rc=$?
  if [ "$rc" -ne 2 ]; then bad "dptrain $* exited $rc, not 2: $(cat err)"
  elif [ "$(wc -l <err)" -ne 1 ]; then bad "dptrain $*: $(wc -l <err) lines on stderr: $(cat err)"
  elif ! grep -qF -- "$want" err; then bad "dptrain $*: '$(cat err)' does not say '$want'"
  else ok; fi
}

# finish [NAME]: the summary line (after "NAME: ") and the exit status of the script.
# shellcheck disable=SC2120  # NAME is optional
finish() {
  echo "${1:+$1: }$passes passed, $fails failed"
  [ "$fails" -eq 0 ]
}
