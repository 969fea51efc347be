"""The table of Axolotl's keys as the docs and the tests read it: every key of axolotl_keys.py's
KEYS with its status (honoured, noted, refused) and what minipar does, in the topics' order
(axolotl_table.py, then axolotl_table_run.py).

    table()       [(key, status, what minipar does), ...]   one row per key: what the tests check
                                                             against Axolotl's schema
    doc_table()   docs/finetuning.md's tables, one per topic; the keys of one topic that share a
                  status and a reason merged into one row:

                      **The model and its tokenizer**

                      | key | status | what minipar does |
                      | --- | --- | --- |
                      | `key_a`, `key_b` | noted | why |

docs/finetuning.md holds doc_table()'s output between the markers `<!-- generated:
axolotl_docs.doc_table() -->` and `<!-- end of generated table -->`, and tests/test_axolotl_keys.py
fails when the two differ, so the page cannot drift from what the loader does. Pure Python.
"""
from __future__ import annotations

from typing import List

from minipar.trainer.config.axolotl_keys import KEYS, TOPICS


def table() -> List[tuple]:
    """(key, status, what minipar does) rows, in the topics' order: for the docs and the tests."""
    return [(k, row.status, row.why) for k, row in KEYS.items()]


def doc_table() -> str:
    """docs/finetuning.md's tables: one per topic, keys of the same status and reason in one row."""
    out = []
    for topic, rows in TOPICS.items():
        merged = {}
        for key, row in rows.items():
            merged.setdefault((row.status, row.why), []).append(f"`{key}`")
        out += [f"**{topic[0].upper() + topic[1:]}**", "", "| key | status | what minipar does |",
                "| --- | --- | --- |"]
        out += [f"| {', '.join(keys)} | {status} | {why.replace('|', '/')} |"
                for (status, why), keys in merged.items()]
        out.append("")
    return "\n".join(out).rstrip("\n")
