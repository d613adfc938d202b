//! A demuxer over an in-memory buffer: a custom `AVIOContext` whose read and seek callbacks
//! work on a `&[u8]` (no temporary file), the container probed from the bytes themselves and
//! checked against a short list of demuxers before FFmpeg parses anything else.
use super::error::VideoError;
use ffmpeg_next::ffi;
use ffmpeg_next::format::context::Input;
use std::ffi::{c_int, c_void, CStr};
use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::ptr;

/// The demuxers allowed, by `AVInputFormat.name` (the mov demuxer reads MP4, MOV, M4V and
/// fragmented MP4).
const DEMUXERS: &[&str] = &["mov,mp4,m4a,3gp,3g2,mj2", "matroska,webm", "avi"];
const DEMUXER_WHITELIST: &str = "mov,mp4,m4a,3gp,3g2,mj2,matroska,webm,avi";
/// FFmpeg's own probe reads up to 1 MiB too.
const PROBE_BYTES: usize = 1 << 20;
const IO_BUFFER: usize = 64 * 1024;

struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
}

unsafe extern "C" fn read_packet(opaque: *mut c_void, buf: *mut u8, size: c_int) -> c_int {
    // SAFETY: `opaque` is the `Reader` that `MemoryInput` owns and outlives the context.
    let r = unsafe { &mut *(opaque as *mut Reader) };
    let left = r.data.len().saturating_sub(r.pos);
    if left == 0 {
        return ffi::AVERROR_EOF;
    }
    let n = left.min(size.max(0) as usize);
    // SAFETY: FFmpeg hands a buffer of `size` bytes; `n <= size` and `pos + n <= len`.
    unsafe { ptr::copy_nonoverlapping(r.data.as_ptr().add(r.pos), buf, n) };
    r.pos += n;
    n as c_int
}

unsafe extern "C" fn seek(opaque: *mut c_void, offset: i64, whence: c_int) -> i64 {
    // SAFETY: as in `read_packet`.
    let r = unsafe { &mut *(opaque as *mut Reader) };
    let len = r.data.len() as i64;
    if whence & ffi::AVSEEK_SIZE != 0 {
        return len;
    }
    let base = match whence & !ffi::AVSEEK_FORCE {
        libc_seek::SET => 0,
        libc_seek::CUR => r.pos as i64,
        libc_seek::END => len,
        _ => return ffi::AVERROR(ffi::EINVAL) as i64,
    };
    match base.checked_add(offset) {
        Some(p) if (0..=len).contains(&p) => {
            r.pos = p as usize;
            p
        }
        _ => ffi::AVERROR(ffi::EINVAL) as i64,
    }
}

mod libc_seek {
    pub const SET: i32 = 0;
    pub const CUR: i32 = 1;
    pub const END: i32 = 2;
}

/// An opened demuxer borrowing the bytes it reads.
pub(super) struct MemoryInput<'a> {
    input: ManuallyDrop<Input>,
    avio: *mut ffi::AVIOContext,
    reader: *mut Reader<'a>,
    /// The demuxer's name, e.g. `mov,mp4,m4a,3gp,3g2,mj2`.
    pub container: String,
    /// The file's size.
    pub len: usize,
    _bytes: PhantomData<&'a [u8]>,
}

impl MemoryInput<'_> {
    pub fn input(&self) -> &Input {
        &self.input
    }
    pub fn input_mut(&mut self) -> &mut Input {
        &mut self.input
    }
}

impl Drop for MemoryInput<'_> {
    fn drop(&mut self) {
        // SAFETY: the format context goes first (with AVFMT_FLAG_CUSTOM_IO it leaves `pb`
        // alone), then the I/O context and its buffer (FFmpeg may have replaced the buffer we
        // allocated, so free the one it holds now), then the reader they pointed at.
        unsafe {
            ManuallyDrop::drop(&mut self.input);
            free_avio(&mut self.avio);
            drop(Box::from_raw(self.reader));
        }
    }
}

unsafe fn free_avio(avio: &mut *mut ffi::AVIOContext) {
    if !avio.is_null() {
        // SAFETY: the caller passes a context from `avio_alloc_context`.
        unsafe {
            ffi::av_freep(ptr::addr_of_mut!((**avio).buffer) as *mut c_void);
            ffi::avio_context_free(avio);
        }
    }
}

/// The demuxer FFmpeg's probe picks for the bytes (the MIME type a client sent is not used),
/// if it is one of [`DEMUXERS`].
fn probe(bytes: &[u8]) -> Result<*const ffi::AVInputFormat, VideoError> {
    let n = bytes.len().min(PROBE_BYTES);
    // The probe reads past the end by up to AVPROBE_PADDING_SIZE zero bytes.
    let mut buf = vec![0u8; n + ffi::AVPROBE_PADDING_SIZE as usize];
    buf[..n].copy_from_slice(&bytes[..n]);
    // SAFETY: a zeroed AVProbeData is valid (null filename and MIME type); `buf` outlives it.
    let fmt = unsafe {
        let mut pd: ffi::AVProbeData = std::mem::zeroed();
        pd.filename = c"".as_ptr();
        pd.buf = buf.as_mut_ptr();
        pd.buf_size = n as c_int;
        let mut score = 0;
        ffi::av_probe_input_format2(&pd, 1, &mut score)
    };
    if fmt.is_null() {
        return Err(VideoError::UnknownContainer);
    }
    // SAFETY: a registered demuxer's name is a static C string.
    let name = unsafe { CStr::from_ptr((*fmt).name) }.to_string_lossy();
    if !DEMUXERS.contains(&name.as_ref()) {
        return Err(VideoError::UnsupportedContainer {
            name: name.into_owned(),
        });
    }
    Ok(fmt)
}

/// Probes and opens `bytes` (the header is parsed; no packet is read yet).
pub(super) fn open(bytes: &[u8]) -> Result<MemoryInput<'_>, VideoError> {
    if bytes.is_empty() {
        return Err(VideoError::Empty);
    }
    super::init();
    let fmt = probe(bytes)?;
    let reader = Box::into_raw(Box::new(Reader {
        data: bytes,
        pos: 0,
    }));
    // SAFETY: every pointer below is checked before use and freed on every path: the reader
    // and the I/O context by hand until `MemoryInput` owns them.
    unsafe {
        let buffer = ffi::av_malloc(IO_BUFFER) as *mut u8;
        let mut avio = if buffer.is_null() {
            ptr::null_mut()
        } else {
            ffi::avio_alloc_context(
                buffer,
                IO_BUFFER as c_int,
                0,
                reader as *mut c_void,
                Some(read_packet),
                None,
                Some(seek),
            )
        };
        if avio.is_null() {
            ffi::av_free(buffer as *mut c_void);
            drop(Box::from_raw(reader));
            return Err(VideoError::Corrupt(
                "out of memory opening the video".into(),
            ));
        }
        let mut ctx = ffi::avformat_alloc_context();
        if ctx.is_null() {
            free_avio(&mut avio);
            drop(Box::from_raw(reader));
            return Err(VideoError::Corrupt(
                "out of memory opening the video".into(),
            ));
        }
        (*ctx).pb = avio;
        (*ctx).flags |= ffi::AVFMT_FLAG_CUSTOM_IO;
        // No URL is ever opened (external references, playlists): no protocol is allowed.
        let mut opts: *mut ffi::AVDictionary = ptr::null_mut();
        let wl = std::ffi::CString::new(DEMUXER_WHITELIST).expect("no NUL");
        ffi::av_dict_set(&mut opts, c"format_whitelist".as_ptr(), wl.as_ptr(), 0);
        ffi::av_dict_set(
            &mut opts,
            c"protocol_whitelist".as_ptr(),
            c"none".as_ptr(),
            0,
        );
        // The decoders FFmpeg's own probing may open (`avformat_find_stream_info`).
        ffi::av_dict_set(
            &mut opts,
            c"codec_whitelist".as_ptr(),
            c"h264,hevc,vp8,vp9,libdav1d,libaom-av1,av1,mpeg4".as_ptr(),
            0,
        );
        // On failure avformat_open_input frees `ctx` (not our `pb`).
        let ret = ffi::avformat_open_input(&mut ctx, ptr::null(), fmt, &mut opts);
        ffi::av_dict_free(&mut opts);
        let container = CStr::from_ptr((*fmt).name).to_string_lossy().into_owned();
        if ret < 0 {
            free_avio(&mut avio);
            drop(Box::from_raw(reader));
            return Err(VideoError::corrupt(
                format!("the {container} header does not parse"),
                ffmpeg_next::Error::from(ret),
            ));
        }
        Ok(MemoryInput {
            input: ManuallyDrop::new(Input::wrap(ctx)),
            avio,
            reader,
            container,
            len: bytes.len(),
            _bytes: PhantomData,
        })
    }
}
