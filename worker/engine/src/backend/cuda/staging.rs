//! One page-locked staging buffer for slot writes that copy one image into
//! a new allocation on a stream (expert LoRA, the tensors outside the
//! layers): refilled only after its last copy finished.

use std::sync::Arc;

use cudarc::driver::{
    CudaEvent, CudaSlice, CudaStream, DeviceRepr, PinnedHostSlice, ValidAsZeroBits,
};
use rayon::prelude::*;

use super::device::{Device, cuda};
use crate::error::Result;

/// The buffer and the end of its last copy.
pub(super) struct Staging<T> {
    held: Option<(PinnedHostSlice<T>, Option<CudaEvent>)>,
}

impl<T> Default for Staging<T> {
    fn default() -> Self {
        Staging { held: None }
    }
}

impl<T: DeviceRepr + ValidAsZeroBits + Copy + Send + Sync> Staging<T> {
    /// A new allocation of `len` values on `copy` holding each of `parts`
    /// at its offset in `at` (values), laid out in page-locked memory in
    /// parallel and copied as one; returns before the copy is done. A
    /// value no part covers is whatever the buffer held: nothing reads it.
    /// `what` names the copy in an error.
    pub fn upload(
        &mut self,
        dev: &Device,
        copy: &Arc<CudaStream>,
        parts: &[&[T]],
        at: &[usize],
        len: usize,
        what: &'static str,
    ) -> Result<CudaSlice<T>> {
        let len = len.max(1);
        let err = cuda(what);
        let (mut host, done) = match self.held.take() {
            Some((host, done)) if host.len() >= len => (host, done),
            old => {
                if let Some((_, Some(e))) = &old {
                    e.synchronize().map_err(&err)?;
                }
                drop(old);
                // SAFETY: the values are plain data, and every value a
                // kernel reads is written first.
                let host = unsafe { dev.ctx.alloc_pinned::<T>(len) }.map_err(&err)?;
                (host, None)
            }
        };
        if let Some(e) = done {
            e.synchronize().map_err(&err)?;
        }
        let staged = host.as_mut_slice().map_err(&err)?;
        let mut pieces = Vec::with_capacity(parts.len());
        let (mut rest, mut from) = (&mut staged[..len], 0);
        for (part, &a) in parts.iter().zip(at) {
            let (_, tail) = rest.split_at_mut(a - from);
            let (mine, tail) = tail.split_at_mut(part.len());
            pieces.push((mine, *part));
            rest = tail;
            from = a + part.len();
        }
        pieces
            .into_par_iter()
            .for_each(|(dst, src)| dst.copy_from_slice(src));
        // SAFETY: every value a kernel reads is written by the copy below
        // before it runs (a step waits for the slot's ready event).
        let data = unsafe { copy.alloc::<T>(len) }.map_err(&err)?;
        // SAFETY: the source is page-locked and is not written again until
        // the event recorded after this copy has fired.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(
                dev.p(&data),
                &staged[..len],
                copy.cu_stream(),
            )
        }
        .map_err(&err)?;
        let done = copy.record_event(None).map_err(&err)?;
        self.held = Some((host, Some(done)));
        Ok(data)
    }
}
