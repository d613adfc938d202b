use super::*;

fn round(x: f32) -> f64 {
    f32::from_bits((bf16_bits(x) as u32) << 16) as f64
}

/// Against f64 sums of the bf16-rounded operands, for every tile shape and edge: rows not a
/// multiple of 12, columns not a multiple of 32, odd k, windows, accumulation.
#[test]
fn matches_rounded_reference_on_all_edges() {
    if !available() {
        vlm_test_support::skip!("no AVX512-BF16 on this CPU");
        return;
    }
    for &(m, n, k) in &[
        (1, 1, 1),
        (5, 70, 13),
        (13, 33, 64),
        (40, 100, 258),
        (300, 64, 96),
    ] {
        let a: Vec<f32> = (0..m * k)
            .map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0)
            .collect();
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 53 % 97) as f32 / 48.0) - 1.0)
            .collect();
        let packed = PackedB::from_rows(&w, n, k, k);
        for accumulate in [false, true] {
            for (parallel, amx) in [(false, false), (true, false), (false, true), (true, true)] {
                let mut c = vec![0.5f32; m * (n + 3)];
                // SAFETY: sizes as documented.
                unsafe {
                    gemm(
                        m,
                        k,
                        a.as_ptr(),
                        k,
                        packed.view().with_amx(amx),
                        c.as_mut_ptr(),
                        n + 3,
                        accumulate,
                        parallel,
                    )
                };
                for r in 0..m {
                    for j in 0..n + 3 {
                        let got = c[r * (n + 3) + j] as f64;
                        if j >= n {
                            assert_eq!(got, 0.5, "column {j} past n was written");
                            continue;
                        }
                        let mut want: f64 = (0..k)
                            .map(|i| round(a[r * k + i]) * round(w[j * k + i]))
                            .sum();
                        if accumulate {
                            want += 0.5;
                        }
                        assert!(
                            (got - want).abs() < 1e-4 * (1.0 + want.abs()),
                            "({m},{n},{k}) [{r},{j}] {got} vs {want}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn windows_select_columns_and_inner_ranges() {
    if !available() {
        vlm_test_support::skip!("no AVX512-BF16 on this CPU");
        return;
    }
    let (n, k) = (96, 40);
    let w: Vec<f32> = (0..n * k).map(|i| (i % 7) as f32 - 3.0).collect();
    let packed = PackedB::from_rows(&w, n, k, k);
    let a: Vec<f32> = (0..3 * k).map(|i| (i % 5) as f32 - 2.0).collect();
    // columns 32..80, inner 10..30: a's columns outside are ignored.
    let view = packed.view().with_amx(true).cols(32, 48).inner(10, 20);
    let mut c = vec![0f32; 3 * 48];
    unsafe {
        gemm(
            3,
            20,
            a[10..].as_ptr(),
            k,
            view,
            c.as_mut_ptr(),
            48,
            false,
            false,
        )
    };
    for r in 0..3 {
        for j in 0..48 {
            let want: f32 = (10..30).map(|i| a[r * k + i] * w[(32 + j) * k + i]).sum();
            assert_eq!(c[r * 48 + j], want);
        }
    }
}

/// The fused fc1 + GELU store gives the bits of the plain product, then `bias_gelu_tanh`,
/// then fc2's rounding of its A (rows not a multiple of 12, a partial last panel, serial
/// and parallel), and leaves the row padding alone.
#[test]
fn bias_gelu_store_is_the_unfused_passes_bit_for_bit() {
    if !available() {
        vlm_test_support::skip!("no AVX512-BF16 on this CPU");
        return;
    }
    for &(m, n, k) in &[(29, 80, 64), (300, 96, 130)] {
        let ldc = n + 32;
        let a: Vec<f32> = (0..m * k)
            .map(|i| ((i * 37 % 101) as f32 / 25.0) - 2.0)
            .collect();
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 53 % 97) as f32 / 48.0) - 1.0)
            .collect();
        let bias: Vec<f32> = (0..n).map(|j| (j as f32 * 0.37).sin()).collect();
        let packed = PackedB::from_rows(&w, n, k, k);
        let mut plain = vec![0f32; m * n];
        // SAFETY: sizes as documented.
        unsafe {
            gemm(
                m,
                k,
                a.as_ptr(),
                k,
                packed.view(),
                plain.as_mut_ptr(),
                n,
                false,
                false,
            )
        };
        crate::kernels::vit_ops::bias_gelu_tanh(&mut plain, &bias);
        let mut want = vec![0u16; n];
        for parallel in [false, true] {
            let mut c = vec![0xabcdu16; m * ldc];
            // SAFETY: sizes as documented.
            unsafe {
                gemm_bias_gelu_bf16(
                    m,
                    k,
                    a.as_ptr(),
                    k,
                    packed.view(),
                    bias.as_ptr(),
                    c.as_mut_ptr(),
                    ldc,
                    parallel,
                )
            };
            for r in 0..m {
                to_bf16(&plain[r * n..(r + 1) * n], &mut want);
                assert_eq!(&c[r * ldc..r * ldc + n], &want[..], "({m},{n},{k}) row {r}");
                assert!(c[r * ldc + n..(r + 1) * ldc].iter().all(|&v| v == 0xabcd));
            }
        }
    }
}

/// The rescaling store: C = C * scale[row] + A·B on every row (tiles of 12 and their
/// remainder, a partial last panel; the AMX cases take the AMX group path where the CPU has
/// AMX, the register tile elsewhere; one row block: the blocks' row offset is the same
/// `Store::at_row` as the tiles').
#[test]
fn rescale_store_scales_each_row_then_adds() {
    if !available() {
        vlm_test_support::skip!("no AVX512-BF16 on this CPU");
        return;
    }
    let (m, n, k) = (53, 70, 96);
    let ldc = n + 5;
    let a: Vec<u16> = (0..m * k)
        .map(|i| bf16_bits(((i * 29 % 89) as f32 / 44.0) - 1.0))
        .collect();
    let w: Vec<f32> = (0..n * k)
        .map(|i| ((i * 53 % 97) as f32 / 48.0) - 1.0)
        .collect();
    let packed = PackedB::from_rows(&w, n, k, k);
    let scale: Vec<f32> = (0..m).map(|r| 0.25 + (r % 7) as f32 * 0.3).collect();
    let c0: Vec<f32> = (0..m * ldc).map(|i| ((i % 11) as f32) - 5.0).collect();
    for (parallel, amx) in [(false, false), (true, false), (false, true), (true, true)] {
        let mut c = c0.clone();
        // SAFETY: sizes as documented.
        unsafe {
            gemm_bf16_a_rescale(
                m,
                a.as_ptr(),
                k,
                packed.view().with_amx(amx),
                c.as_mut_ptr(),
                ldc,
                scale.as_ptr(),
                parallel,
            )
        };
        for r in 0..m {
            for j in 0..ldc {
                let got = c[r * ldc + j] as f64;
                if j >= n {
                    assert_eq!(got, c0[r * ldc + j] as f64, "column {j} past n");
                    continue;
                }
                let dot: f64 = (0..k)
                    .map(|i| {
                        f32::from_bits((a[r * k + i] as u32) << 16) as f64 * round(w[j * k + i])
                    })
                    .sum();
                let want = c0[r * ldc + j] as f64 * scale[r] as f64 + dot;
                assert!(
                    (got - want).abs() < 1e-4 * (1.0 + want.abs()),
                    "parallel {parallel} amx {amx} [{r},{j}] {got} vs {want}"
                );
            }
        }
    }
}

#[test]
fn a_row_alone_equals_the_same_row_in_a_batch() {
    if !available() {
        vlm_test_support::skip!("no AVX512-BF16 on this CPU");
        return;
    }
    let (n, k) = (64, 300);
    let w: Vec<f32> = (0..n * k).map(|i| ((i * 31 % 89) as f32).sin()).collect();
    let packed = PackedB::from_rows(&w, n, k, k);
    let a: Vec<f32> = (0..7 * k).map(|i| ((i * 17 % 83) as f32).cos()).collect();
    let mut batch = vec![0f32; 7 * n];
    let mut one = vec![0f32; n];
    unsafe {
        gemm(
            7,
            k,
            a.as_ptr(),
            k,
            packed.view().with_amx(true),
            batch.as_mut_ptr(),
            n,
            false,
            true,
        );
        gemm(
            1,
            k,
            a[3 * k..].as_ptr(),
            k,
            packed.view().with_amx(true),
            one.as_mut_ptr(),
            n,
            false,
            false,
        );
    }
    assert_eq!(&batch[3 * n..4 * n], &one[..]);
}

#[test]
fn gate_up_silu_equals_the_product_then_the_silu() {
    if !available() {
        vlm_test_support::skip!("no AVX512-BF16 on this CPU");
        return;
    }
    let val = |i: usize, s: usize| (((i * s) % 97) as f32 - 48.0) / 19.0;
    // Odd k (a padded pair), rows below, at and past the 12-row tile, several tasks.
    for (inter, k, m) in [(48, 7, 1), (64, 130, 12), (32, 64, 13), (16 * 24, 33, 29)] {
        let g: Vec<f32> = (0..inter * k).map(|i| val(i, 7)).collect();
        let u: Vec<f32> = (0..inter * k).map(|i| val(i, 11)).collect();
        let (gp, up) = (
            PackedB::from_rows(&g, inter, k, k),
            PackedB::from_rows(&u, inter, k, k),
        );
        let both = PackedB::interleave_gate_up(&gp, &up).unwrap();
        let a: Vec<f32> = (0..m * k).map(|i| val(i, 5) / 4.0).collect();
        // [gate | up] per row, each product on its own.
        let mut plain = vec![0f32; m * 2 * inter];
        let mut fused = vec![f32::NAN; m * inter];
        unsafe {
            let c = plain.as_mut_ptr();
            gemm(m, k, a.as_ptr(), k, gp.view(), c, 2 * inter, false, true);
            gemm(
                m,
                k,
                a.as_ptr(),
                k,
                up.view(),
                c.add(inter),
                2 * inter,
                false,
                true,
            );
            gemm_gate_up_silu(
                m,
                k,
                a.as_ptr(),
                k,
                both.view(),
                fused.as_mut_ptr(),
                inter,
                true,
            );
        }
        let mut want = vec![0f32; m * inter];
        for r in 0..m {
            let y = &plain[r * 2 * inter..(r + 1) * 2 * inter];
            crate::kernels::softmax::silu_mul_row(
                &y[..inter],
                &y[inter..],
                &mut want[r * inter..(r + 1) * inter],
            );
        }
        assert_eq!(
            fused.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "inter {inter} k {k} m {m}"
        );
    }
}

#[test]
fn a_given_in_bf16_equals_a_rounded_by_the_kernel() {
    if !available() {
        vlm_test_support::skip!("no AVX512-BF16 on this CPU");
        return;
    }
    let (m, n, k) = (29, 70, 64);
    let w: Vec<f32> = (0..n * k).map(|i| ((i * 7 % 61) as f32).sin()).collect();
    let packed = PackedB::from_rows(&w, n, k, k);
    let a: Vec<f32> = (0..m * k).map(|i| ((i * 13 % 71) as f32).cos()).collect();
    let lda16 = k + 32;
    let mut a16 = vec![0u16; m * lda16];
    for r in 0..m {
        for i in 0..k {
            a16[r * lda16 + i] = bf16_bits(a[r * k + i]);
        }
    }
    let (mut want, mut got) = (vec![0.5f32; m * n], vec![0.5f32; m * n]);
    unsafe {
        gemm(
            m,
            k,
            a.as_ptr(),
            k,
            packed.view().with_amx(true),
            want.as_mut_ptr(),
            n,
            true,
            true,
        );
        gemm_bf16_a(
            m,
            a16.as_ptr(),
            lda16,
            packed.view().with_amx(true),
            got.as_mut_ptr(),
            n,
            true,
            true,
        );
    }
    assert_eq!(got, want);
}

/// The AMX tiles and the AVX512 register tile compute the same sums (up to f32 rounding:
/// the two add a pair's products in different orders), over whole 16-pair chunks, a tail,
/// partial 16- and 32-row groups and bf16 A given with a partial last group.
#[test]
fn amx_tiles_agree_with_the_register_tile() {
    if !available() || !super::super::amx::available() {
        vlm_test_support::skip!("no AMX-BF16 on this CPU");
        return;
    }
    for &(m, n, k) in &[
        (1, 64, 64),
        (8, 96, 544),
        (17, 33, 96),
        (45, 70, 70),
        (64, 32, 32),
        // Two AMX row blocks (576 + 524 rows: 8 MiB holds 992 rows of k 4096) of 32-row
        // groups, three runs of four panels (the L2 budget at k 4096), a partial last panel.
        (1100, 330, 4096),
        // An inner tail past the 16-pair chunks, two-panel runs.
        (70, 100, 6150),
    ] {
        let w: Vec<f32> = (0..n * k).map(|i| ((i * 29 % 83) as f32).sin()).collect();
        let packed = PackedB::from_rows(&w, n, k, k);
        let a: Vec<f32> = (0..m * k).map(|i| ((i * 11 % 67) as f32).cos()).collect();
        let kp = k.next_multiple_of(2);
        let a16: Vec<u16> = (0..m * kp)
            .map(|i| {
                if i % kp < k {
                    bf16_bits(a[i / kp * k + i % kp])
                } else {
                    0
                }
            })
            .collect();
        let run = |avx512_only: bool, bf16_a: bool| {
            let view = packed.view().with_amx(!avx512_only);
            let mut c = vec![0.25f32; m * n];
            unsafe {
                if bf16_a {
                    gemm_bf16_a(m, a16.as_ptr(), kp, view, c.as_mut_ptr(), n, true, true);
                } else {
                    gemm(m, k, a.as_ptr(), k, view, c.as_mut_ptr(), n, true, true);
                }
            }
            c
        };
        let want = run(true, false);
        // The two kernels sum the pairs in different orders: their f32 rounding differs by
        // up to a small multiple of eps times the sum of |terms|.
        let scale = |i: usize| {
            let (r, col) = (i / n, i % n);
            (0..k)
                .map(|j| (a[r * k + j] * w[col * k + j]).abs())
                .sum::<f32>()
        };
        for bf16_a in [false, true] {
            let got = run(false, bf16_a);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (g - w).abs() <= 1e-5 * (1.0 + w.abs()) + 1e-6 * scale(i),
                    "({m},{n},{k}) bf16 A {bf16_a} at {i}: {g} vs {w}"
                );
            }
        }
        // On the tiles, the last rows alone (one small block) give the same bits as in the
        // whole product (blocks of a thousand rows, 32-row groups over runs of panels).
        let tail = m.min(40);
        let mut alone = vec![0.25f32; tail * n];
        unsafe {
            gemm(
                tail,
                k,
                a[(m - tail) * k..].as_ptr(),
                k,
                packed.view().with_amx(true),
                alone.as_mut_ptr(),
                n,
                true,
                true,
            );
        }
        assert_eq!(
            &run(false, false)[(m - tail) * n..],
            &alone[..],
            "({m},{n},{k})"
        );
        // Sub-runs of one panel, of a whole task (no L2 prefetch), blocks of 32 rows and
        // the default: the blocking moves the loads, not the sums.
        for (a_block_bytes, subrun_bytes) in [(8 << 20, 1), (8 << 20, 1 << 20), (1, 256 << 10)] {
            let mut c = vec![0.25f32; m * n];
            unsafe {
                gemm(
                    m,
                    k,
                    a.as_ptr(),
                    k,
                    packed.view().with_amx(true).with_amx_blocking(AmxBlocking {
                        a_block_bytes,
                        subrun_bytes,
                    }),
                    c.as_mut_ptr(),
                    n,
                    true,
                    true,
                );
            }
            assert_eq!(
                c,
                run(false, false),
                "({m},{n},{k}) A blocks of {a_block_bytes} B, sub-runs of {subrun_bytes} B"
            );
        }
    }
}
