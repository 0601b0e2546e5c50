# What the CLI test scripts share (sourced): pass/fail counting, and `refuse`, the check
# that bad input gets exactly one error line and exit status 2, at once. Needs $exe.
# shellcheck shell=bash
fails=0 passes=0
ok() { passes=$((passes + 1)); }
bad() { echo "FAIL: $*"; fails=$((fails + 1)); }

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

# The summary line and the exit status of the script.
finish() {
  echo "$passes passed, $fails failed"
  [ "$fails" -eq 0 ]
}
