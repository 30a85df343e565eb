"""What a start shows: the known harmless third-party lines are dropped at their source, nothing else is."""

import logging

from app.quiet import silence_known_noise


class _Kept(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_transformers_unused_loss_notice_is_dropped_and_its_other_warnings_show():
    silence_known_noise()
    logger = logging.getLogger("transformers.modeling_utils")  # (transformers' loggers do not propagate to root)
    kept = _Kept()
    logger.addHandler(kept)
    try:
        logger.warning("`loss_type=None` was set in the config but it is unrecognized. Using the default loss")
        logger.warning("Some weights of the checkpoint were not used")
    finally:
        logger.removeHandler(kept)
    assert kept.messages == ["Some weights of the checkpoint were not used"]


def test_gptqmodel_keeps_its_warnings_only():
    from logbar import LogBar

    from app.quiet import quiet_gptqmodel

    quiet_gptqmodel()
    shared = LogBar.shared()
    assert not shared.isEnabledFor(logging.INFO) and shared.isEnabledFor(logging.WARNING)
