"""Workloads whose answers repeat their input: editing code, quoting a passage, answering from a
document by quoting it. Where speculative decoding from the context pays (docs/speculative-decoding.md);
`lmserve bench --workload repeat` and server/bench/speculation_bench.py send them."""

from __future__ import annotations

CODE = '''def mean_and_spread(values):
    total = 0.0
    for v in values:
        total += v
    mean = total / len(values)
    spread = 0.0
    for v in values:
        spread += (v - mean) ** 2
    return mean, (spread / len(values)) ** 0.5
'''

PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He carried a brass lamp, "
           "a tin of oil and a notebook in which he wrote down the colour of the sea. On stormy nights he "
           "stayed awake until dawn, watching the beam sweep across the water and counting the ships that "
           "passed safely into the harbour.")

DOCUMENT = ("Shipping notice. The ferry to the northern islands leaves at 7:15 every weekday from pier 4. "
            "Tickets cost 12 euros for adults and 6 euros for children under twelve. Bicycles travel free. "
            "On Saturdays the first ferry leaves at 9:30, and there is no service on Sundays. In storms the "
            "harbour master may cancel crossings; cancellations are posted on the board beside the ticket office.")

REPEATING = {
    "code_edit": f"Rename the variable `total` to `acc` in this function and show the whole function:\n\n{CODE}",
    "quote": f"Repeat the following paragraph word for word:\n\n{PASSAGE}",
    "document_qa": f"{DOCUMENT}\n\nQuote the sentences of the notice that say when the ferries leave.",
}
