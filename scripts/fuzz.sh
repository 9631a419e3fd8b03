#!/usr/bin/env bash
# Runs every fuzz target of the packages given (default ./...) for FUZZTIME each (default 5s).
#
# Each package's test binary is built once, instrumented for fuzzing (`go test -c -fuzz`), and
# every target of the package is fuzzed from it, in the package's directory and with the go
# command's fuzz cache, as `go test -fuzz` would: `go test -fuzz` links a binary per target,
# which costs more than a few seconds of fuzzing for a package with a dozen targets.
#
# Go 1.26's fuzzing coordinator can report "context deadline exceeded" as a failure when
# -fuzztime ends while a worker is mid-input (golang/go#75804, fixed in Go 1.27). Such a run
# found nothing: no failing input is written to testdata/fuzz. A failure is therefore reported
# only when the target wrote a failing input, or failed for any other reason; a bare deadline
# is retried once, then reported if it happens again.
set -euo pipefail
GO=${GO:-go}
FUZZTIME=${FUZZTIME:-5s}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
log=$tmp/log
bin=$tmp/fuzz.test
cache=$($GO env GOCACHE)/fuzz

# corpus lists the failing inputs stored for target $2 in package directory $1.
corpus() { ls "$1/testdata/fuzz/$2" 2>/dev/null | sort || true; }

for pkg in $($GO list "${@:-./...}"); do
  dir=$($GO list -f '{{.Dir}}' "$pkg")
  targets=$(grep -ho '^func Fuzz[A-Za-z0-9_]*' "$dir"/*_test.go 2>/dev/null | sed 's/func //' || true)
  [ -n "$targets" ] || continue
  if ! $GO test -c -fuzz . -o "$bin" "$pkg" >"$log" 2>&1; then
    cat "$log"
    exit 1
  fi
  for f in $targets; do
    echo "fuzz $pkg $f"
    for try in 1 2; do
      before=$(corpus "$dir" "$f")
      if (cd "$dir" && "$bin" -test.run '^$' -test.fuzz "^$f\$" -test.fuzztime "$FUZZTIME" \
        -test.fuzzcachedir "$cache/$pkg" -test.paniconexit0) >"$log" 2>&1; then
        break
      fi
      after=$(corpus "$dir" "$f")
      if [ "$try" = 1 ] && [ "$before" = "$after" ] && grep -q '^    context deadline exceeded$' "$log" &&
        ! grep -q 'Failing input written' "$log"; then
        echo "  $f stopped on Go's fuzzing deadline with no failing input (golang/go#75804): running it again"
        continue
      fi
      cat "$log"
      exit 1
    done
  done
done
