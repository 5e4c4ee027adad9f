//! DEVICE_SET_IRQS validation, in the order libvfio-user's `device_set_irqs_validate`
//! applies its checks, plus the checks that depend on this function's capabilities.

use crate::device::{
    DeviceError, IrqAction, IrqData, SetIrqs, VFIO_PCI_ERR_IRQ_INDEX, VFIO_PCI_INTX_IRQ_INDEX,
    VFIO_PCI_NUM_IRQS, VFIO_PCI_REQ_IRQ_INDEX,
};

/// What validation needs to know of an index.
#[derive(Clone, Copy, Debug)]
pub(super) struct IndexShape {
    /// Vectors in the index.
    pub(super) vectors: u32,
    /// MASK/UNMASK are supported.
    pub(super) maskable: bool,
}

/// Checks `req` against the index it names; `shape(index)` describes an index below
/// [`VFIO_PCI_NUM_IRQS`].
pub(super) fn validate(req: &SetIrqs, shape: impl Fn(u32) -> IndexShape) -> Result<(), DeviceError> {
    let index = req.index;
    let invalid = |why| Err(DeviceError::InvalidIrqs { index, why });
    if index >= VFIO_PCI_NUM_IRQS {
        return Err(DeviceError::NoSuchIrq(index));
    }
    let shape = shape(index);
    if shape.vectors == 0 {
        return Err(DeviceError::NoSuchIrq(index));
    }
    if matches!(index, VFIO_PCI_ERR_IRQ_INDEX | VFIO_PCI_REQ_IRQ_INDEX) && req.action != IrqAction::Trigger {
        return invalid("ERR and REQ support TRIGGER only");
    }
    if req.count == 0 {
        if req.action != IrqAction::Trigger || !matches!(req.data, IrqData::None) {
            return invalid("count 0 is only for TRIGGER with DATA_NONE (disable)");
        }
        if req.start != 0 {
            return invalid("count 0 (disable) needs start 0");
        }
        return Ok(());
    }
    match req.start.checked_add(req.count) {
        Some(end) if end <= shape.vectors => {}
        _ => return invalid("start + count exceeds the vector count"),
    }
    match &req.data {
        IrqData::Bool(flags) if flags.len() != req.count as usize => {
            return invalid("DATA_BOOL needs one flag per vector");
        }
        IrqData::Eventfds(fds) if !fds.is_empty() && fds.len() != req.count as usize => {
            return invalid("DATA_EVENTFD needs one fd per vector, or none to de-assign");
        }
        _ => {}
    }
    match (req.action, &req.data) {
        (IrqAction::Mask | IrqAction::Unmask, _) if !shape.maskable => {
            invalid("the index is not maskable (MSI without per-vector masking, ERR, REQ)")
        }
        (IrqAction::Mask, IrqData::Eventfds(_)) => Err(DeviceError::Unsupported("mask eventfds")),
        (IrqAction::Unmask, IrqData::Eventfds(_)) if index != VFIO_PCI_INTX_IRQ_INDEX => {
            Err(DeviceError::Unsupported("unmask eventfds outside INTx"))
        }
        _ => Ok(()),
    }
}
