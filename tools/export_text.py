"""Export Ambrose Bierce's *The Devil's Dictionary* (public domain) to ``src/polytrain/data/devils_dictionary.txt.gz``.

Run once; polytrain never needs the Debian package at run time. The text comes from Debian's ``dict-devil``
package (the Internet Wiretap 1st Online Edition, 1993, of the 1911 Albert and Charles Boni edition; its
copyright file: "The Devil's Dictionary is in the public domain, its copyright has expired"):

    apt-get download dict-devil && dpkg-deb -x dict-devil_*.deb /tmp/devil
    python tools/export_text.py /tmp/devil/usr/share/dictd/devil.dict.dz

The dictd file is gzip-compatible plain text: dictd's own header entries come first and an alphabet entry
last; the export keeps the book from its PREFACE to its last entry (ZOOLOGY), unchanged, as ASCII.
"""

import gzip
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "src" / "polytrain" / "data" / "devils_dictionary.txt.gz"
FIRST = "PREFACE"
LAST_ENTRY = "ZOOLOGY, n."


def book_text(dict_dz: Path) -> str:
    raw = gzip.decompress(dict_dz.read_bytes()).decode("ascii")
    start = raw.index(FIRST)
    start = raw.rindex("\n", 0, start) + 1  # keep the line's indentation
    last = raw.index(LAST_ENTRY)
    end = raw.index("\n\n", last)  # the entry ends at the first blank line; dictd's alphabet entry follows
    return raw[start:end].rstrip() + "\n"


def main() -> None:
    text = book_text(Path(sys.argv[1] if len(sys.argv) > 1 else "/usr/share/dictd/devil.dict.dz"))
    with OUT.open("wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9, mtime=0) as gz:
        gz.write(text.encode("ascii"))  # mtime=0: the same input gives the same bytes
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes): {len(text)} characters, {text.count(chr(10))} lines")


if __name__ == "__main__":
    main()
