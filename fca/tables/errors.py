"""The errors FCA reports to users. Each message is one line naming the file (or input) and what is
wrong; the CLI prints it as `fca: error: ...` and the dashboard as `st.error`. Torch-free on purpose."""


class CorpusError(ValueError):
    """A corpus that cannot be used."""


class ModelLoadError(ValueError):
    """A model directory that cannot be loaded."""


class CacheError(ValueError):
    """A coefficient cache that cannot be used."""


class ExactnessError(RuntimeError):
    """Correct replay did not reproduce the live logits: no other figure may be reported."""


class Cancelled(RuntimeError):
    """The caller asked a long run to stop."""
