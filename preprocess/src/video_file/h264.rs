//! The H.264 side of an MP4 track: the `avcC` configuration record, the sequence parameter set
//! (profile, chroma format, bit depth, frame size) and MP4's length-prefixed NAL units turned
//! into the Annex-B byte stream OpenH264's decoder reads.
use crate::error::{PreprocessError, Result};

/// NAL unit types (H.264 table 7-1) this module looks at.
pub(super) const NAL_SLICE_IDR: u8 = 5;
pub(super) const NAL_SPS: u8 = 7;
pub(super) const NAL_PPS: u8 = 8;

/// OpenH264's decoder limit (level 5.2): at most 36864 macroblocks a frame, e.g. 4096x2304.
pub(super) const MAX_FRAME_MBS: u64 = 36864;

const START_CODE: [u8; 4] = [0, 0, 0, 1];

fn corrupt(msg: impl std::fmt::Display) -> PreprocessError {
    PreprocessError::invalid(format!("corrupt H.264 stream: {msg}"))
}

/// `AVCDecoderConfigurationRecord` (ISO/IEC 14496-15 5.3.3.1).
#[derive(Debug, Clone)]
pub(super) struct AvcConfig {
    /// Bytes in each NAL unit's length prefix in the samples: 1, 2 or 4.
    pub length_size: usize,
    pub sps: Vec<Vec<u8>>,
    pub pps: Vec<Vec<u8>>,
}

pub(super) fn parse_avcc(body: &[u8]) -> Result<AvcConfig> {
    let bad = |what: &str| corrupt(format!("the avcC box is truncated ({what})"));
    if body.len() < 6 {
        return Err(bad("header"));
    }
    if body[0] != 1 {
        return Err(corrupt(format!(
            "avcC configurationVersion is {}; only version 1 exists",
            body[0]
        )));
    }
    let length_size = (body[4] & 3) as usize + 1;
    if length_size == 3 {
        return Err(corrupt(
            "avcC says NAL length prefixes of 3 bytes; only 1, 2 or 4 are valid",
        ));
    }
    fn read_sets(body: &[u8], pos: &mut usize, count: usize, what: &str) -> Result<Vec<Vec<u8>>> {
        let bad = || corrupt(format!("the avcC box is truncated (in its {what}s)"));
        let mut sets = Vec::with_capacity(count);
        for _ in 0..count {
            let len_bytes = body.get(*pos..*pos + 2).ok_or_else(bad)?;
            let len = u16::from_be_bytes([len_bytes[0], len_bytes[1]]) as usize;
            let nal = body.get(*pos + 2..*pos + 2 + len).ok_or_else(bad)?;
            if nal.is_empty() {
                return Err(corrupt(format!("the avcC box has an empty {what}")));
            }
            sets.push(nal.to_vec());
            *pos += 2 + len;
        }
        Ok(sets)
    }
    let mut pos = 6;
    let sps = read_sets(body, &mut pos, (body[5] & 0x1f) as usize, "SPS")?;
    let pps_count = *body.get(pos).ok_or_else(|| bad("PPS count"))? as usize;
    pos += 1;
    let pps = read_sets(body, &mut pos, pps_count, "PPS")?;
    Ok(AvcConfig {
        length_size,
        sps,
        pps,
    })
}

/// What the video path needs from a sequence parameter set (H.264 7.3.2.1.1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Sps {
    pub profile_idc: u8,
    pub constraint_flags: u8,
    pub level_idc: u8,
    pub chroma_format_idc: u32,
    pub bit_depth_luma: u32,
    pub bit_depth_chroma: u32,
    pub frame_mbs_only: bool,
    pub width_mbs: u32,
    pub height_map_units: u32,
    /// The displayed (cropped) frame size.
    pub width: u32,
    pub height: u32,
    /// VUI `matrix_coefficients` (H.273): 1 BT.709, 5/6 BT.601, 9 BT.2020, ...; 2
    /// (unspecified) when the SPS does not say.
    pub matrix: u8,
    /// VUI `video_full_range_flag`: samples span 0..255 instead of 16..235/240.
    pub full_range: bool,
}

impl Sps {
    /// Macroblocks in a frame (both fields of an interlaced frame).
    pub fn frame_mbs(&self) -> u64 {
        let frame_height_mbs =
            self.height_map_units as u64 * if self.frame_mbs_only { 1 } else { 2 };
        self.width_mbs as u64 * frame_height_mbs
    }

    /// e.g. "High profile, level 3.1".
    pub fn describe(&self) -> String {
        format!(
            "{} profile, level {}",
            profile_name(self.profile_idc, self.constraint_flags),
            level_name(self.level_idc, self.constraint_flags)
        )
    }
}

pub(super) fn profile_name(profile_idc: u8, constraint_flags: u8) -> String {
    let constraint_set1 = constraint_flags & 0x40 != 0;
    let name = match profile_idc {
        66 if constraint_set1 => "Constrained Baseline",
        66 => "Baseline",
        77 => "Main",
        88 => "Extended",
        100 => "High",
        110 => "High 10",
        122 => "High 4:2:2",
        244 => "High 4:4:4 Predictive",
        44 => "CAVLC 4:4:4 Intra",
        83 => "Scalable Baseline",
        86 => "Scalable High",
        118 => "Multiview High",
        128 => "Stereo High",
        134 => "MFC High",
        135 => "MFC Depth High",
        138 => "Multiview Depth High",
        139 => "Enhanced Multiview Depth High",
        other => return format!("unknown (profile_idc {other})"),
    };
    name.to_string()
}

fn level_name(level_idc: u8, constraint_flags: u8) -> String {
    // Level 1b is level_idc 11 with constraint_set3 in the Baseline/Main/Extended profiles.
    if level_idc == 11 && constraint_flags & 0x10 != 0 {
        return "1b".to_string();
    }
    format!("{}.{}", level_idc / 10, level_idc % 10)
}

/// Refuses what OpenH264's decoder does not decode (or would decode wrongly), naming it:
/// profiles other than (Constrained) Baseline, Main and High; chroma other than 4:2:0; more
/// than 8 bits; interlaced coding; frames over its 36864-macroblock limit.
pub(super) fn check_supported(sps: &Sps) -> Result<()> {
    const SUPPORTED: &str =
        "OpenH264 decodes the Constrained Baseline, Baseline, Main and High profiles (8-bit 4:2:0, progressive)";
    if !matches!(sps.profile_idc, 66 | 77 | 100) {
        return Err(PreprocessError::invalid(format!(
            "unsupported H.264 profile: {} (profile_idc {}); {SUPPORTED}",
            profile_name(sps.profile_idc, sps.constraint_flags),
            sps.profile_idc
        )));
    }
    let what = || {
        format!(
            "H.264 {} profile",
            profile_name(sps.profile_idc, sps.constraint_flags)
        )
    };
    if sps.chroma_format_idc != 1 {
        let chroma = match sps.chroma_format_idc {
            0 => "4:0:0 (monochrome)",
            2 => "4:2:2",
            _ => "4:4:4",
        };
        return Err(PreprocessError::invalid(format!(
            "unsupported {} video with {chroma} chroma; {SUPPORTED}",
            what()
        )));
    }
    if sps.bit_depth_luma != 8 || sps.bit_depth_chroma != 8 {
        return Err(PreprocessError::invalid(format!(
            "unsupported {} video with {}-bit luma and {}-bit chroma; {SUPPORTED}",
            what(),
            sps.bit_depth_luma,
            sps.bit_depth_chroma
        )));
    }
    if !sps.frame_mbs_only {
        return Err(PreprocessError::invalid(format!(
            "unsupported interlaced {} video (field or MBAFF coding); {SUPPORTED}",
            what()
        )));
    }
    let mbs = sps.frame_mbs();
    let side_limit = 8 * MAX_FRAME_MBS; // level 5.2: each side in MBs at most sqrt(8 * MaxFS)
    let (w, h) = (sps.width_mbs as u64, sps.height_map_units as u64);
    if mbs > MAX_FRAME_MBS || w * w > side_limit || h * h > side_limit {
        return Err(PreprocessError::invalid(format!(
            "H.264 frame {}x{} is {} macroblocks ({}x{}); OpenH264 decodes at most {MAX_FRAME_MBS} \
             macroblocks a frame (level 5.2, e.g. 4096x2304) and at most 543 a side",
            sps.width, sps.height, mbs, w, h
        )));
    }
    Ok(())
}

/// The RBSP of a NAL unit: the payload after the one-byte header with the emulation
/// prevention bytes (`00 00 03` -> `00 00`) removed.
fn rbsp(nal: &[u8]) -> Vec<u8> {
    let payload = nal.get(1..).unwrap_or(&[]);
    let mut out = Vec::with_capacity(payload.len());
    let mut zeros = 0;
    for &b in payload {
        if zeros >= 2 && b == 3 {
            zeros = 0;
            continue;
        }
        zeros = if b == 0 { zeros + 1 } else { 0 };
        out.push(b);
    }
    out
}

/// An MSB-first bit reader with Exp-Golomb codes (H.264 9.1).
struct Bits<'a> {
    data: &'a [u8],
    pos: usize,
}

impl Bits<'_> {
    fn bit(&mut self) -> Result<u32> {
        let byte = self
            .data
            .get(self.pos / 8)
            .ok_or_else(|| corrupt("the SPS is truncated"))?;
        let bit = (byte >> (7 - self.pos % 8)) & 1;
        self.pos += 1;
        Ok(bit as u32)
    }

    fn bits(&mut self, n: u32) -> Result<u32> {
        let mut v = 0;
        for _ in 0..n {
            v = (v << 1) | self.bit()?;
        }
        Ok(v)
    }

    fn flag(&mut self) -> Result<bool> {
        Ok(self.bit()? == 1)
    }

    fn ue(&mut self) -> Result<u32> {
        let mut zeros = 0;
        while self.bit()? == 0 {
            zeros += 1;
            if zeros > 31 {
                return Err(corrupt("an Exp-Golomb code in the SPS is over 32 bits"));
            }
        }
        let rest = self.bits(zeros)?;
        Ok(((1u64 << zeros) - 1 + rest as u64).min(u32::MAX as u64) as u32)
    }

    fn se(&mut self) -> Result<i64> {
        let k = self.ue()? as i64;
        Ok(if k % 2 == 1 { (k + 1) / 2 } else { -(k / 2) })
    }
}

/// Parses a sequence parameter set NAL unit (with its header byte) up to the frame cropping.
pub(super) fn parse_sps(nal: &[u8]) -> Result<Sps> {
    if nal.first().map(|h| h & 0x1f) != Some(NAL_SPS) {
        return Err(corrupt("the parameter set is not an SPS (NAL unit type 7)"));
    }
    let data = rbsp(nal);
    let mut r = Bits {
        data: &data,
        pos: 0,
    };
    let profile_idc = r.bits(8)? as u8;
    let constraint_flags = r.bits(8)? as u8;
    let level_idc = r.bits(8)? as u8;
    let sps_id = r.ue()?;
    if sps_id > 31 {
        return Err(corrupt(format!("seq_parameter_set_id {sps_id} is over 31")));
    }
    let (mut chroma_format_idc, mut bit_depth_luma, mut bit_depth_chroma) = (1, 8, 8);
    if matches!(
        profile_idc,
        100 | 110 | 122 | 244 | 44 | 83 | 86 | 118 | 128 | 138 | 139 | 134 | 135
    ) {
        chroma_format_idc = r.ue()?;
        if chroma_format_idc > 3 {
            return Err(corrupt(format!(
                "chroma_format_idc {chroma_format_idc} is over 3"
            )));
        }
        if chroma_format_idc == 3 {
            r.flag()?; // separate_colour_plane_flag
        }
        bit_depth_luma = r.ue()?.saturating_add(8);
        bit_depth_chroma = r.ue()?.saturating_add(8);
        r.flag()?; // qpprime_y_zero_transform_bypass_flag
        if r.flag()? {
            // seq_scaling_matrix_present_flag: skip the scaling lists (7.3.2.1.1.1).
            let lists = if chroma_format_idc == 3 { 12 } else { 8 };
            for i in 0..lists {
                if r.flag()? {
                    let size = if i < 6 { 16 } else { 64 };
                    let (mut last, mut next) = (8i64, 8i64);
                    for _ in 0..size {
                        if next != 0 {
                            let delta = r.se()?;
                            next = (last + delta).rem_euclid(256);
                        }
                        if next != 0 {
                            last = next;
                        }
                    }
                }
            }
        }
    }
    r.ue()?; // log2_max_frame_num_minus4
    match r.ue()? {
        0 => {
            r.ue()?; // log2_max_pic_order_cnt_lsb_minus4
        }
        1 => {
            r.flag()?; // delta_pic_order_always_zero_flag
            r.se()?; // offset_for_non_ref_pic
            r.se()?; // offset_for_top_to_bottom_field
            let cycle = r.ue()?;
            if cycle > 255 {
                return Err(corrupt(format!(
                    "num_ref_frames_in_pic_order_cnt_cycle {cycle} is over 255"
                )));
            }
            for _ in 0..cycle {
                r.se()?;
            }
        }
        2 => {}
        other => {
            return Err(corrupt(format!("pic_order_cnt_type {other} is over 2")));
        }
    }
    r.ue()?; // max_num_ref_frames
    r.flag()?; // gaps_in_frame_num_value_allowed_flag
    let width_mbs = r.ue()?.saturating_add(1);
    let height_map_units = r.ue()?.saturating_add(1);
    let frame_mbs_only = r.flag()?;
    if !frame_mbs_only {
        r.flag()?; // mb_adaptive_frame_field_flag
    }
    r.flag()?; // direct_8x8_inference_flag
    let full_w = width_mbs as u64 * 16;
    let full_h = height_map_units as u64 * 16 * if frame_mbs_only { 1 } else { 2 };
    let (mut width, mut height) = (full_w, full_h);
    if r.flag()? {
        // frame_cropping_flag: offsets in chroma sample units (7-19, 7-20).
        let (crop_x, crop_y) = match chroma_format_idc {
            0 | 3 => (1, 1),
            1 => (2, 2),
            _ => (2, 1),
        };
        let crop_y = crop_y * if frame_mbs_only { 1 } else { 2 };
        let (l, rt, t, b) = (
            r.ue()? as u64,
            r.ue()? as u64,
            r.ue()? as u64,
            r.ue()? as u64,
        );
        let cut_w = (l + rt) * crop_x;
        let cut_h = (t + b) * crop_y;
        if cut_w >= full_w || cut_h >= full_h {
            return Err(corrupt(format!(
                "the SPS crops {cut_w}x{cut_h} off a {full_w}x{full_h} frame"
            )));
        }
        width -= cut_w;
        height -= cut_h;
    }
    // The colour signalling of the VUI, which the reference's conversion to RGB follows. The
    // decoder does not need it: a VUI cut short leaves the defaults.
    let (matrix, full_range) = vui_colour(&mut r).unwrap_or((2, false));
    Ok(Sps {
        profile_idc,
        constraint_flags,
        level_idc,
        chroma_format_idc,
        bit_depth_luma,
        bit_depth_chroma,
        frame_mbs_only,
        width_mbs,
        height_map_units,
        width: width.min(u32::MAX as u64) as u32,
        height: height.min(u32::MAX as u64) as u32,
        matrix,
        full_range,
    })
}

/// `(matrix_coefficients, video_full_range_flag)` from the VUI (E.1.1), after the frame
/// cropping fields; `(2, false)` (unspecified, limited range) for what it does not signal.
fn vui_colour(r: &mut Bits<'_>) -> Result<(u8, bool)> {
    if !r.flag()? {
        return Ok((2, false)); // vui_parameters_present_flag
    }
    if r.flag()? && r.bits(8)? == 255 {
        // aspect_ratio_info_present_flag, aspect_ratio_idc == Extended_SAR
        r.bits(32)?; // sar_width, sar_height
    }
    if r.flag()? {
        r.flag()?; // overscan_info_present_flag -> overscan_appropriate_flag
    }
    if !r.flag()? {
        return Ok((2, false)); // video_signal_type_present_flag
    }
    r.bits(3)?; // video_format
    let full_range = r.flag()?;
    let matrix = if r.flag()? {
        r.bits(16)?; // colour_primaries, transfer_characteristics
        r.bits(8)? as u8
    } else {
        2
    };
    Ok((matrix, full_range))
}

/// Calls `f` with each NAL unit of an MP4 sample (NAL units each after a big-endian length of
/// `length_size` bytes).
pub(super) fn for_each_nal(
    sample: &[u8],
    length_size: usize,
    mut f: impl FnMut(&[u8]) -> Result<()>,
) -> Result<()> {
    let mut rest = sample;
    while !rest.is_empty() {
        let Some((len_bytes, tail)) = rest.split_at_checked(length_size) else {
            return Err(corrupt(format!(
                "{} stray bytes after the last NAL unit of a sample",
                rest.len()
            )));
        };
        let len = len_bytes.iter().fold(0usize, |v, &b| (v << 8) | b as usize);
        let Some((nal, tail)) = tail.split_at_checked(len) else {
            return Err(corrupt(format!(
                "a NAL unit of {len} bytes runs past the end of its {}-byte sample",
                sample.len()
            )));
        };
        if nal.is_empty() {
            return Err(corrupt("a sample holds an empty NAL unit"));
        }
        if nal[0] & 0x80 != 0 {
            return Err(corrupt("a NAL unit has its forbidden_zero_bit set"));
        }
        f(nal)?;
        rest = tail;
    }
    Ok(())
}

/// Appends `nal` to an Annex-B byte stream.
pub(super) fn push_annexb(out: &mut Vec<u8>, nal: &[u8]) {
    out.extend_from_slice(&START_CODE);
    out.extend_from_slice(nal);
}

/// Splits an Annex-B byte stream (as OpenH264's encoder writes it) into NAL units without their
/// start codes.
pub(super) fn split_annexb(stream: &[u8]) -> Vec<&[u8]> {
    let mut starts = Vec::new();
    let mut i = 0;
    while i + 3 <= stream.len() {
        if stream[i] == 0 && stream[i + 1] == 0 && stream[i + 2] == 1 {
            starts.push(i + 3);
            i += 3;
        } else {
            i += 1;
        }
    }
    let mut nals = Vec::with_capacity(starts.len());
    for (k, &s) in starts.iter().enumerate() {
        let mut end = starts.get(k + 1).map_or(stream.len(), |&n| n - 3);
        // A four-byte start code leaves one more zero before the next start.
        while end > s && stream[end - 1] == 0 && k + 1 < starts.len() {
            end -= 1;
        }
        if end > s {
            nals.push(&stream[s..end]);
        }
    }
    nals
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_golomb() {
        // 1 -> 0, 010 -> 1, 011 -> 2, 00100 -> 3; then se: 010 -> +1, 011 -> -1.
        let data = [0b1010_0110, 0b0100_0100, 0b1100_0000];
        let mut r = Bits {
            data: &data,
            pos: 0,
        };
        assert_eq!(
            (r.ue().unwrap(), r.ue().unwrap(), r.ue().unwrap()),
            (0, 1, 2)
        );
        assert_eq!(r.ue().unwrap(), 3);
        assert_eq!((r.se().unwrap(), r.se().unwrap()), (1, -1));
    }

    #[test]
    fn emulation_prevention_is_removed() {
        assert_eq!(rbsp(&[0x67, 0, 0, 3, 1, 0, 0, 3]), vec![0, 0, 1, 0, 0]);
    }

    #[test]
    fn sps_of_a_high_profile_stream() {
        // x264, High profile level 1.0, 64x48 (4x3 MBs, no cropping).
        let sps = [
            0x67, 0x64, 0x00, 0x0a, 0xac, 0xd9, 0x44, 0x7a, 0x10, 0x00, 0x00, 0x03, 0x00, 0x10,
            0x00, 0x00, 0x03, 0x01, 0x00, 0xf1, 0x22, 0x59, 0x60,
        ];
        let s = parse_sps(&sps).unwrap();
        assert_eq!((s.profile_idc, s.width, s.height), (100, 64, 48));
        assert_eq!((s.chroma_format_idc, s.bit_depth_luma), (1, 8));
        assert!(s.frame_mbs_only);
        check_supported(&s).unwrap();
        assert_eq!(s.describe(), "High profile, level 1.0");
    }

    #[test]
    fn unsupported_sps_are_named() {
        let mut s = Sps {
            profile_idc: 110,
            constraint_flags: 0,
            level_idc: 30,
            chroma_format_idc: 1,
            bit_depth_luma: 10,
            bit_depth_chroma: 10,
            frame_mbs_only: true,
            width_mbs: 4,
            height_map_units: 3,
            width: 64,
            height: 48,
            matrix: 2,
            full_range: false,
        };
        let e = check_supported(&s).unwrap_err().to_string();
        assert!(e.contains("High 10") && e.contains("110"), "{e}");
        s.profile_idc = 100;
        let e = check_supported(&s).unwrap_err().to_string();
        assert!(e.contains("10-bit"), "{e}");
        s.bit_depth_luma = 8;
        s.bit_depth_chroma = 8;
        s.frame_mbs_only = false;
        let e = check_supported(&s).unwrap_err().to_string();
        assert!(e.contains("interlaced"), "{e}");
        s.frame_mbs_only = true;
        s.width_mbs = 512;
        s.height_map_units = 288;
        let e = check_supported(&s).unwrap_err().to_string();
        assert!(e.contains("36864"), "{e}");
    }

    #[test]
    fn length_prefixed_nals() {
        let sample = [0, 0, 0, 2, 0x65, 0xaa, 0, 0, 0, 1, 0x41];
        let mut seen = Vec::new();
        for_each_nal(&sample, 4, |n| {
            seen.push(n.to_vec());
            Ok(())
        })
        .unwrap();
        assert_eq!(seen, vec![vec![0x65, 0xaa], vec![0x41]]);
        assert!(for_each_nal(&sample[..9], 4, |_| Ok(())).is_err());
        assert!(for_each_nal(&[0, 0, 0, 9, 1], 4, |_| Ok(())).is_err());
        assert!(for_each_nal(&[0, 0], 4, |_| Ok(())).is_err());
    }

    #[test]
    fn annexb_split() {
        let stream = [
            0, 0, 0, 1, 0x67, 1, 2, 0, 0, 1, 0x68, 3, 0, 0, 0, 1, 0x65, 0, 4,
        ];
        assert_eq!(
            split_annexb(&stream),
            vec![&[0x67, 1, 2][..], &[0x68, 3][..], &[0x65, 0, 4][..]]
        );
    }
}
