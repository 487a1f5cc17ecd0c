"""A device-split loss scaler for FSDP + AMP. The whole scaler is in scaler.py."""
from scaler_impl.scaler import DeviceSplitGradScaler


def make_scaler(**kwargs) -> DeviceSplitGradScaler:
    """Factory with the conformance suite's signature: `--scaler scaler_impl:make_scaler`."""
    return DeviceSplitGradScaler(**kwargs)


__all__ = ["DeviceSplitGradScaler", "make_scaler"]
