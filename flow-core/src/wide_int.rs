//! 256-bit integers as little-endian two's complement bytes, the form in which decimals and
//! `int128` .. `uint256` values travel: parsed from and printed as decimal digits without loss,
//! with no allocation (digits go through a fixed stack buffer).

/// 10^0 ..= 10^38, every power of ten below 2^128.
const POW10: [u128; 39] = {
    let mut table = [1u128; 39];
    let mut i = 1;
    while i < 39 {
        table[i] = table[i - 1] * 10;
        i += 1;
    }
    table
};

/// A 256-bit integer as four little-endian 64-bit limbs of its two's complement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WideInt {
    limbs: [u64; 4],
}

impl WideInt {
    /// Zero.
    pub const ZERO: WideInt = WideInt { limbs: [0; 4] };

    /// Sign-extends `bytes` (little-endian two's complement of 1..=32 bytes; `signed` says whether
    /// the top bit is a sign).
    pub fn from_le_bytes(bytes: &[u8], signed: bool) -> WideInt {
        let negative = signed && bytes.last().is_some_and(|b| b & 0x80 != 0);
        let mut full = [if negative { 0xff } else { 0 }; 32];
        let n = bytes.len().min(32);
        full[..n].copy_from_slice(&bytes[..n]);
        let mut limbs = [0u64; 4];
        for (i, limb) in limbs.iter_mut().enumerate() {
            let mut word = [0u8; 8];
            word.copy_from_slice(&full[i * 8..i * 8 + 8]);
            *limb = u64::from_le_bytes(word);
        }
        WideInt { limbs }
    }

    /// `v`, sign-extended.
    pub fn from_i128(v: i128) -> WideInt {
        WideInt::from_le_bytes(&v.to_le_bytes(), true)
    }

    /// The low `out.len()` bytes; `None` unless the value survives the truncation (as a signed
    /// or an unsigned number of that width).
    pub fn to_le_bytes_checked(&self, out: &mut [u8], signed: bool) -> Option<()> {
        let full = self.to_le_bytes();
        let n = out.len();
        out.copy_from_slice(&full[..n]);
        (WideInt::from_le_bytes(out, signed) == *self).then_some(())
    }

    /// All 32 bytes, little-endian two's complement.
    pub fn to_le_bytes(&self) -> [u8; 32] {
        let mut out = [0u8; 32];
        for (i, limb) in self.limbs.iter().enumerate() {
            out[i * 8..i * 8 + 8].copy_from_slice(&limb.to_le_bytes());
        }
        out
    }

    /// As a signed number: the top bit of the 256 is set.
    pub fn is_negative(&self) -> bool {
        self.limbs[3] >> 63 == 1
    }

    fn negate(&self) -> WideInt {
        let mut limbs = [0u64; 4];
        let mut carry = true;
        for (out, limb) in limbs.iter_mut().zip(self.limbs) {
            let (v, c) = (!limb).overflowing_add(u64::from(carry));
            *out = v;
            carry = c;
        }
        WideInt { limbs }
    }

    /// `self * 10 + digit` on the 256-bit magnitude; `None` past 2^256 - 1.
    fn mul10_add(&self, digit: u64) -> Option<WideInt> {
        let mut limbs = [0u64; 4];
        let mut carry = u128::from(digit);
        for (out, limb) in limbs.iter_mut().zip(self.limbs) {
            let v = u128::from(limb) * 10 + carry;
            *out = v as u64;
            carry = v >> 64;
        }
        (carry == 0).then_some(WideInt { limbs })
    }

    /// Divides the magnitude by 10 in place; returns the remainder.
    fn div10(&mut self) -> u8 {
        let mut rem = 0u128;
        for limb in self.limbs.iter_mut().rev() {
            let v = (rem << 64) | u128::from(*limb);
            *limb = (v / 10) as u64;
            rem = v % 10;
        }
        rem as u8
    }

    fn is_zero(&self) -> bool {
        self.limbs == [0; 4]
    }

    /// Parses decimal digits (an optional sign, then `0-9` only) as an unsigned magnitude with a
    /// sign; `None` for anything else or a magnitude past 2^256 - 1.
    fn parse_magnitude(digits: &str) -> Option<(bool, WideInt)> {
        let (negative, digits) = match digits.as_bytes().first() {
            Some(b'-') => (true, &digits[1..]),
            Some(b'+') => (false, &digits[1..]),
            _ => (false, digits),
        };
        if digits.is_empty() {
            return None;
        }
        let mut value = WideInt::ZERO;
        for b in digits.bytes() {
            if !b.is_ascii_digit() {
                return None;
            }
            value = value.mul10_add(u64::from(b - b'0'))?;
        }
        Some((negative, value))
    }

    /// Parses an integer for a type of `bits` width, signed or not; the error says why.
    pub fn parse_integer(text: &str, bits: u32, signed: bool) -> Result<WideInt, String> {
        let (negative, magnitude) = WideInt::parse_magnitude(text.trim())
            .ok_or_else(|| format!("`{text}` is not an integer"))?;
        let out_of_range = || {
            let (name, range) = if signed {
                ("int", format!("-2^{} to 2^{}-1", bits - 1, bits - 1))
            } else {
                ("uint", format!("0 to 2^{bits}-1"))
            };
            format!("{text} is out of range for {name}{bits} ({range})")
        };
        let negative = negative && !magnitude.is_zero();
        if negative && !signed {
            return Err(out_of_range());
        }
        let value = if negative {
            magnitude.negate()
        } else {
            magnitude
        };
        let mut buf = [0u8; 32];
        let width = (bits / 8) as usize;
        let survives = value
            .to_le_bytes_checked(&mut buf[..width], signed)
            .is_some();
        // A signed magnitude past the sign bit wraps to the other sign.
        if !survives || (signed && value.is_negative() != negative) {
            return Err(out_of_range());
        }
        Ok(value)
    }

    /// Parses a decimal number (`-12.345`, `1e3` is not accepted) as the integer of its value
    /// times 10^scale, with at most `precision` digits in all. More fractional digits than
    /// `scale` are accepted only when the extra ones are zeros: nothing is rounded.
    pub fn parse_decimal(text: &str, precision: u8, scale: u8) -> Result<WideInt, String> {
        let trimmed = text.trim();
        let not_decimal = || format!("`{text}` is not a decimal number");
        let (int_part, frac_part) = match trimmed.split_once('.') {
            Some((i, f)) => (i, f),
            None => (trimmed, ""),
        };
        let (negative, int_digits) = match int_part.as_bytes().first() {
            Some(b'-') => (true, &int_part[1..]),
            Some(b'+') => (false, &int_part[1..]),
            _ => (false, int_part),
        };
        if (int_digits.is_empty() && frac_part.is_empty())
            || !int_digits.bytes().all(|b| b.is_ascii_digit())
            || !frac_part.bytes().all(|b| b.is_ascii_digit())
        {
            return Err(not_decimal());
        }
        let frac_kept = frac_part.len().min(scale.into());
        if frac_part[frac_kept..].bytes().any(|b| b != b'0') {
            return Err(format!(
                "{text} has more than {scale} digits after the point (decimal({precision},{scale}))"
            ));
        }
        let int_digits = int_digits.trim_start_matches('0');
        if int_digits.len() + usize::from(scale) > usize::from(precision) {
            return Err(format!(
                "{text} has more than {} digits before the point (decimal({precision},{scale}))",
                precision - scale
            ));
        }
        let mut value = WideInt::ZERO;
        let digits = int_digits
            .bytes()
            .chain(frac_part[..frac_kept].bytes())
            .chain(std::iter::repeat_n(b'0', usize::from(scale) - frac_kept));
        for b in digits {
            // At most 76 digits: below 2^256.
            value = value
                .mul10_add(u64::from(b - b'0'))
                .ok_or_else(not_decimal)?;
        }
        Ok(if negative { value.negate() } else { value })
    }

    /// The value as an `i128`, when it is one (the common case for decimals up to 38 digits,
    /// which then skip the 256-bit arithmetic).
    fn as_i128(&self) -> Option<i128> {
        let low = u128::from(self.limbs[0]) | (u128::from(self.limbs[1]) << 64);
        let sign = if (low as i128) < 0 { u64::MAX } else { 0 };
        (self.limbs[2] == sign && self.limbs[3] == sign).then_some(low as i128)
    }

    /// `self * 10^digits` (self read as signed); `None` past 256 bits.
    pub fn checked_scale_up(&self, digits: u8) -> Option<WideInt> {
        if digits == 0 {
            return Some(*self);
        }
        if let Some(v) = self.as_i128() {
            let scaled = POW10
                .get(usize::from(digits))
                .and_then(|p| i128::try_from(*p).ok())
                .and_then(|p| v.checked_mul(p));
            if let Some(scaled) = scaled {
                return Some(WideInt::from_i128(scaled));
            }
        }
        let negative = self.is_negative();
        let mut magnitude = if negative { self.negate() } else { *self };
        for _ in 0..digits {
            magnitude = magnitude.mul10_add(0)?;
        }
        if magnitude.is_negative() {
            return None;
        }
        Some(if negative {
            magnitude.negate()
        } else {
            magnitude
        })
    }

    /// Whether |self| < 10^precision (self read as signed).
    pub fn fits_precision(&self, precision: u8) -> bool {
        if let Some(v) = self.as_i128() {
            // Every i128 is below 10^39.
            return POW10
                .get(usize::from(precision))
                .is_none_or(|limit| v.unsigned_abs() < *limit);
        }
        let mut magnitude = if self.is_negative() {
            self.negate()
        } else {
            *self
        };
        for _ in 0..precision {
            if magnitude.is_zero() {
                return true;
            }
            magnitude.div10();
        }
        magnitude.is_zero()
    }

    /// Writes the value in decimal, signed or not, with `scale` digits after a point.
    pub fn write_decimal(&self, signed: bool, scale: u8, out: &mut impl std::fmt::Write) {
        let negative = signed && self.is_negative();
        let mut magnitude = if negative { self.negate() } else { *self };
        // 2^256 has 78 digits.
        let mut digits = [0u8; 80];
        let mut n = 0;
        while !magnitude.is_zero() || n <= usize::from(scale) {
            digits[n] = b'0' + magnitude.div10();
            n += 1;
        }
        if negative {
            let _ = out.write_char('-');
        }
        for i in (0..n).rev() {
            let _ = out.write_char(char::from(digits[i]));
            if i == usize::from(scale) && scale > 0 {
                let _ = out.write_char('.');
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(v: &WideInt, signed: bool, scale: u8) -> String {
        let mut s = String::new();
        v.write_decimal(signed, scale, &mut s);
        s
    }

    #[test]
    fn decimals_parse_and_print_without_loss() {
        let v = WideInt::parse_decimal("-12.3400", 9, 4).unwrap();
        assert_eq!(v, WideInt::from_i128(-123_400));
        assert_eq!(text(&v, true, 4), "-12.3400");
        assert_eq!(text(&WideInt::ZERO, true, 2), "0.00");
        assert_eq!(text(&WideInt::from_i128(5), true, 2), "0.05");
        let max76 = "9".repeat(76);
        let v = WideInt::parse_decimal(&max76, 76, 0).unwrap();
        assert_eq!(text(&v, true, 0), max76);
        assert!(v.fits_precision(76));
        assert!(!v.fits_precision(75));
        assert_eq!(
            WideInt::parse_decimal("1.005", 9, 2).unwrap_err(),
            "1.005 has more than 2 digits after the point (decimal(9,2))"
        );
        assert_eq!(
            WideInt::parse_decimal("1.500", 9, 1).unwrap(),
            WideInt::from_i128(15)
        );
        assert_eq!(
            WideInt::parse_decimal("1000", 5, 2).unwrap_err(),
            "1000 has more than 3 digits before the point (decimal(5,2))"
        );
        for bad in ["", ".", "1e3", "1.2.3", "--1", "0x10", "1 2"] {
            assert!(WideInt::parse_decimal(bad, 9, 2).is_err(), "{bad}");
        }
    }

    #[test]
    fn integers_parse_at_their_width_bounds() {
        let i128_min = i128::MIN.to_string();
        let v = WideInt::parse_integer(&i128_min, 128, true).unwrap();
        assert_eq!(v, WideInt::from_i128(i128::MIN));
        assert!(WideInt::parse_integer(&(i128::MAX as u128 + 1).to_string(), 128, true).is_err());
        let u128_max = u128::MAX.to_string();
        let v = WideInt::parse_integer(&u128_max, 128, false).unwrap();
        assert_eq!(text(&v, false, 0), u128_max);
        assert!(WideInt::parse_integer("-1", 128, false).is_err());
        assert!(WideInt::parse_integer("-0", 128, false).is_ok());
        let u256_max =
            "115792089237316195423570985008687907853269984665640564039457584007913129639935";
        let v = WideInt::parse_integer(u256_max, 256, false).unwrap();
        assert_eq!(v.to_le_bytes(), [0xff; 32]);
        assert_eq!(text(&v, false, 0), u256_max);
        assert!(WideInt::parse_integer(u256_max, 256, true).is_err());
        let i256_min =
            "-57896044618658097711785492504343953926634992332820282019728792003956564819968";
        let v = WideInt::parse_integer(i256_min, 256, true).unwrap();
        assert_eq!(text(&v, true, 0), i256_min);
        let i256_over =
            "57896044618658097711785492504343953926634992332820282019728792003956564819968";
        assert!(WideInt::parse_integer(i256_over, 256, true).is_err());
        assert!(WideInt::parse_integer(&format!("{u256_max}0"), 256, false).is_err());
    }

    #[test]
    fn precision_and_scaling_agree_across_the_128_bit_boundary() {
        let nines38 = WideInt::from_i128(10i128.pow(38) - 1);
        assert!(nines38.fits_precision(38));
        assert!(!nines38.fits_precision(37));
        assert!(WideInt::from_i128(i128::MIN).fits_precision(39));
        assert!(!WideInt::from_i128(i128::MIN).fits_precision(38));
        let scaled = nines38.checked_scale_up(2).unwrap();
        assert_eq!(text(&scaled, true, 0), format!("{}00", "9".repeat(38)));
        assert!(scaled.fits_precision(40) && !scaled.fits_precision(39));
        let negative = WideInt::from_i128(-5).checked_scale_up(40).unwrap();
        assert_eq!(text(&negative, true, 0), format!("-5{}", "0".repeat(40)));
        assert!(WideInt::from_i128(1).checked_scale_up(78).is_none());
    }
}
