#!/usr/bin/env bash
# Product text speaks of what the product does, not of how it was developed: none of the
# periods it was written in, no numbered runs or issues, no "here"/"there" for the machines it
# was built and measured on.
# Greps the README, docs/*.md, examples/, scripts/, the Python package and its extension's
# sources (python/commfuse, python/src) and every file under crates/ (sources and their
# comments), and exits 1 listing each hit as file:line: text.
# CHANGELOG.md is exempt: a changelog may carry dates and the story of a change.
set -euo pipefail
cd "$(dirname "$0")/.."

# one alternative per kind of hit (extended regexps, matched without regard to case)
PATTERN='\bsessions?\b|\brun [0-9]+\b|\bissue [0-9]+\b|\((here|there)\)'
# words that contain a pattern and are no hit: a process session (setsid)
ALLOWED='process sessions?|setsid'

paths=(README.md examples scripts python/commfuse python/src crates)
for doc in docs/*.md; do
  [ -e "$doc" ] && paths+=("$doc")
done

hits=0
while IFS= read -r hit; do
  # file:line:text; the text without its allowed words must still match
  text=${hit#*:*:}
  if printf '%s\n' "$text" | sed -E "s/$ALLOWED//Ig" | grep -qiE "$PATTERN"; then
    printf '%s\n' "$hit"
    hits=$((hits + 1))
  fi
done < <(grep -rnIiE "$PATTERN" "${paths[@]}" 2>/dev/null || true)

if [ "$hits" -gt 0 ]; then
  echo "check-product-text: $hits line(s) speak of how the product was developed" >&2
  exit 1
fi
echo "check-product-text: OK"
