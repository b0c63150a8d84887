"""``python -m ckptd.knobs``: print the table of every knob that docs/operations.md carries."""

from ckptd.knobs.knob import markdown_table

__all__: list[str] = []

if __name__ == "__main__":  # running the package imported every knob's definition first
    print(markdown_table(), end="")
