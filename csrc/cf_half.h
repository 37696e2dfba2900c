/*
 * cf_half.h -- bf16 / fp16 <-> fp32 conversions in portable C11 (integer bit
 * manipulation only; no _Float16, no F16C intrinsics).
 *
 * Design.  These reproduce torch's CPU conversions bit for bit on every
 * non-NaN input: widening is exact; narrowing rounds to nearest, ties to even,
 * including subnormal results and overflow to +-inf.  NaN stays NaN (quiet);
 * torch's own NaN bit patterns differ between its scalar and vectorised
 * paths, so only "is NaN" is part of the contract.  Narrowing from fp64 is
 * done by the caller as (float) first and then these functions, which is what
 * torch does (c10::BFloat16 and c10::Half are constructed from float).
 */
#ifndef CF_HALF_H
#define CF_HALF_H

#include <stdint.h>
#include <string.h>

static inline uint32_t cf_f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float cf_bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* bf16 -> fp32: exact (bf16 is the top half of an fp32). */
static inline float cf_bf16_to_f32(uint16_t h)
{
    return cf_bits_f32((uint32_t)h << 16);
}

/* fp32 -> bf16, round to nearest even; NaN -> 0x7FC0 (c10's choice). */
static inline uint16_t cf_f32_to_bf16(float f)
{
    uint32_t u = cf_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return 0x7fc0u;
    u += 0x7fffu + ((u >> 16) & 1u); /* cannot wrap: u <= 0xff800000 */
    return (uint16_t)(u >> 16);
}

/* fp16 -> fp32: exact; NaN keeps its sign and payload. */
static inline float cf_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    if (exp == 0x1fu)
        return cf_bits_f32(sign | 0x7f800000u | (mant << 13));
    if (exp != 0)
        return cf_bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
    /* zero or subnormal: mant * 2^-24, exact in fp32 */
    float mag = (float)mant * 0x1p-24f;
    return sign ? -mag : mag;
}

/* fp32 -> fp16, round to nearest even (subnormals too); overflow -> inf. */
static inline uint16_t cf_f32_to_f16(float f)
{
    uint32_t u = cf_f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) /* NaN: quiet, keep sign and top payload bits */
        return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a >= 0x477ff000u) /* |f| >= 65520 rounds to inf (inf included) */
        return (uint16_t)(sign | 0x7c00u);
    if (a >= 0x38800000u) { /* normal fp16 result (carry may bump exp) */
        a += 0x0fffu + ((a >> 13) & 1u);
        return (uint16_t)(sign | ((a - 0x38000000u) >> 13));
    }
    if (a <= 0x33000000u) /* |f| <= 2^-25: rounds to zero (tie to even) */
        return sign;
    { /* subnormal fp16 result: round(m * 2^(e-150) / 2^-24) */
        uint32_t e = a >> 23; /* 102..112 */
        uint32_t m = (a & 0x7fffffu) | 0x800000u;
        uint32_t sh = 126u - e; /* 14..24 */
        uint32_t q = m >> sh;
        uint32_t rem = m & ((1u << sh) - 1u);
        uint32_t half = 1u << (sh - 1u);
        if (rem > half || (rem == half && (q & 1u)))
            q++; /* q == 0x400 is the smallest normal: still correct */
        return (uint16_t)(sign | q);
    }
}

#endif /* CF_HALF_H */
