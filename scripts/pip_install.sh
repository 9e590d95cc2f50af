#!/usr/bin/env bash
# pip install into a venv, tried again when the download breaks off.
#   bash scripts/pip_install.sh VENV ARGS...        (ARGS as for `pip install`)
# A package registry's connection can drop mid-wheel (CI once lost a 228 MB CUDA wheel at 194 MB five
# times in a row). pip resumes a broken download itself (--resume-retries); when even that gives up,
# the whole install is run again after a pause (PIP_TRIES times, default 4; wheels already fetched come
# from pip's cache). The exit status is pip's last one: a failure is never swallowed.
# pip's "is ignored: it is neither a file nor a directory" notes (PIP_FIND_LINKS on machines without
# that folder) are filtered out of the output.
set -uo pipefail
VENV=$1
shift
TRIES=${PIP_TRIES:-4}
PY="$VENV/bin/python"
resume=()
if "$PY" -m pip install --help 2>/dev/null | grep -q -- "--resume-retries"; then
  resume=(--resume-retries 20)
fi
rc=1
for try in $(seq 1 "$TRIES"); do
  "$PY" -m pip --disable-pip-version-check -q install "${resume[@]}" "$@" 2>&1 \
    | grep -v "is ignored: it is neither"
  rc=${PIPESTATUS[0]}
  if [ "$rc" -eq 0 ]; then
    exit 0
  fi
  if [ "$try" -lt "$TRIES" ]; then
    pause=$((30 * try))
    echo "pip_install: pip install $* failed (exit $rc, try $try of $TRIES); trying again in ${pause} s" >&2
    sleep "$pause"
  fi
done
echo "pip_install: pip install $* failed $TRIES times (last exit $rc)" >&2
exit "$rc"
