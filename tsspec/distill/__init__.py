"""``tsspec distill``: train a drafter on the trunk's own behaviour (see ``train``).

Sits beside ``session``: it loads a trunk (``models``), writes a file a drafter adapter
(``drafters``) loads, and is driven by the CLI.
"""
