"""The transport between a trainer process and its node's daemon."""
