"""The errors users see as one line (pretrain_gpt.py prints them and sets the exit code).
Here, in the config package, so that the command line imports no torch to report them."""


class ConfigError(ValueError):
    """A flag (or file named by a flag) breaks a rule. str() is the one line users see."""

    def __init__(self, flag: str, rule: str):
        super().__init__(f"{flag}: {rule}")
        self.flag = flag


class CheckpointError(ValueError):
    """A --load checkpoint is unreadable or does not fit the model. One line for users."""


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. every step skipped for non-finite values): one line,
    exit 1, nothing saved past the last good checkpoint."""


def require(ok: bool, flag: str, rule: str) -> None:
    """Raise ConfigError(flag, rule) unless `ok`."""
    if not ok:
        raise ConfigError(flag, rule)
