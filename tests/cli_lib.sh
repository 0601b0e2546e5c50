# What the CLI test scripts share (sourced): pass/fail counting, a temporary folder, the
# check that a resumed run ends bit-identically, and `refuse`, the check that bad input
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
