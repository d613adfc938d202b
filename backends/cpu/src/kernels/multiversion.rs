//! `multiversion!`: an elementwise kernel written once as plain Rust, compiled three times
//! (AVX-512, AVX2+FMA, portable) and picked at run time by what the CPU has, so that LLVM
//! vectorises branch-free loops at the widest width available.

macro_rules! multiversion {
    ($(#[$m:meta])* pub fn $name:ident($($arg:ident: $ty:ty),*) $body:block) => {
        $(#[$m])*
        pub fn $name($($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")]
                unsafe fn fast512($($arg: $ty),*) $body
                if std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bw")
                    && std::arch::is_x86_feature_detected!("avx512dq")
                    && std::arch::is_x86_feature_detected!("avx512vl")
                {
                    // SAFETY: the features were detected on this CPU.
                    return unsafe { fast512($($arg),*) };
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn fast($($arg: $ty),*) $body
                if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                    // SAFETY: the features were detected on this CPU.
                    return unsafe { fast($($arg),*) };
                }
            }
            fn portable($($arg: $ty),*) $body
            portable($($arg),*)
        }
    };
}

pub(crate) use multiversion;
