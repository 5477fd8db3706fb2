"""The errors FCA reports to users. Each message is one line naming the file (or input) and what is
wrong; the CLI prints it as `fca: error: ...` and the dashboard as `st.error`. Torch-free on purpose."""


class CorpusError(ValueError):
    """A corpus that cannot be used."""


class ModelLoadError(ValueError):
    """A model directory that cannot be loaded."""


class CacheError(ValueError):
    """A coefficient cache that cannot be used."""


class SiteError(KeyError, ValueError):
    """A site name that the model or cache lacks, or a site given no coefficients. A ValueError, as every
    other bad input to `fca.replay`, and a KeyError (a lookup by name) as before; its message without
    the quotes a KeyError's str() adds."""

    __str__ = ValueError.__str__


class ExactnessError(RuntimeError):
    """Correct replay did not reproduce the live logits: no other figure may be reported."""


class Cancelled(RuntimeError):
    """The caller asked a long run to stop."""
