//! Money: a positive decimal amount with at most 4 decimal places and 15 integer digits (it fits
//! PostgreSQL `numeric(19,4)`), in an ISO 4217 currency.

use std::fmt;
use std::str::FromStr;

use rust_decimal::Decimal;
use thiserror::Error;

/// Largest number of digits before the decimal point.
pub const MAX_INTEGER_DIGITS: usize = 15;
/// Largest number of digits after the decimal point.
pub const MAX_SCALE: u32 = 4;

/// Why an amount or currency was rejected.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum MoneyError {
    #[error("amount must be a decimal number written as digits with an optional fraction, like \"12.34\"")]
    /// Not a decimal string.
    Malformed,
    #[error("amount must be greater than zero")]
    /// Zero or negative.
    NotPositive,
    #[error("amount must have at most {MAX_SCALE} decimal places")]
    /// More than 4 decimals.
    TooPrecise,
    #[error("amount must have at most {MAX_INTEGER_DIGITS} integer digits")]
    /// More than 15 integer digits.
    TooLarge,
    #[error("currency must be an ISO 4217 code of three upper-case letters")]
    /// Not three upper-case letters.
    MalformedCurrency,
    #[error("currency {0} is not an ISO 4217 currency")]
    /// Not an active ISO 4217 code with a minor unit.
    UnknownCurrency(String),
    #[error("{currency} amounts have at most {minor_units} decimal places (ISO 4217 minor units)")]
    /// More decimals than the currency's minor unit allows.
    FinerThanMinorUnit {
        /// The currency.
        currency: String,
        /// Its minor unit (decimals allowed).
        minor_units: u32,
    },
}

/// A positive amount of money, at most 15 integer digits and 4 decimal places.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Amount(Decimal);

impl Amount {
    /// Parses a plain decimal string: ASCII digits, optionally a `.` and more digits. No sign, exponent,
    /// whitespace or thousands separators. Trailing zeros in the fraction do not count as precision.
    pub fn parse(s: &str) -> Result<Self, MoneyError> {
        if s.is_empty() || s.len() > 64 {
            return Err(MoneyError::Malformed);
        }
        let (int, frac) = match s.split_once('.') {
            Some((i, f)) => (i, Some(f)),
            None => (s, None),
        };
        let digits = |p: &str| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit());
        if !digits(int) || frac.is_some_and(|f| !digits(f)) {
            return Err(MoneyError::Malformed);
        }
        if int.trim_start_matches('0').len() > MAX_INTEGER_DIGITS {
            return Err(MoneyError::TooLarge);
        }
        if frac.is_some_and(|f| f.trim_end_matches('0').len() > MAX_SCALE as usize) {
            return Err(MoneyError::TooPrecise);
        }
        let value = Decimal::from_str(s).map_err(|_| MoneyError::Malformed)?;
        Self::try_from(value)
    }

    /// The value, with scale exactly 4 (as stored).
    pub fn value(self) -> Decimal {
        self.0
    }
}

impl TryFrom<Decimal> for Amount {
    type Error = MoneyError;

    fn try_from(value: Decimal) -> Result<Self, MoneyError> {
        if value <= Decimal::ZERO {
            return Err(MoneyError::NotPositive);
        }
        let mut normalized = value.normalize();
        if normalized.scale() > MAX_SCALE {
            return Err(MoneyError::TooPrecise);
        }
        if normalized.trunc().abs() >= Decimal::from(10_i64.pow(MAX_INTEGER_DIGITS as u32)) {
            return Err(MoneyError::TooLarge);
        }
        normalized.rescale(MAX_SCALE);
        Ok(Self(normalized))
    }
}

impl fmt::Display for Amount {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Renders a stored amount with exactly 4 decimal places, as the API and events show money.
pub fn format_amount(value: Decimal, currency: &str) -> String {
    let scale = Currency::parse(currency).map_or(MAX_SCALE, |c| c.minor_units());
    let mut v = value;
    v.rescale(scale);
    v.to_string()
}

/// An active ISO 4217 currency code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Currency([u8; 3]);

impl Currency {
    /// Validates an active ISO 4217 code (superseded, fund and special codes refused).
    pub fn parse(s: &str) -> Result<Self, MoneyError> {
        let bytes: [u8; 3] = s.as_bytes().try_into().map_err(|_| MoneyError::MalformedCurrency)?;
        if !bytes.iter().all(u8::is_ascii_uppercase) {
            return Err(MoneyError::MalformedCurrency);
        }
        match iso_currency::Currency::from_code(s) {
            Some(c) if accepted(c) => Ok(Self(bytes)),
            _ => Err(MoneyError::UnknownCurrency(s.to_owned())),
        }
    }

    /// Every code [`Currency::parse`] accepts, with its minor units, in code order (the API document
    /// lists them).
    pub fn accepted_codes() -> Vec<(&'static str, u32)> {
        use iso_currency::IntoEnumIterator;
        let mut codes: Vec<(&'static str, u32)> = iso_currency::Currency::iter()
            .filter(|c| accepted(*c))
            .filter_map(|c| Some((c.code(), u32::from(c.exponent()?))))
            .collect();
        codes.sort_unstable();
        codes
    }

    /// ISO 4217 minor units: the most decimal places an amount in this currency may have (JPY 0, EUR 2,
    /// BHD 3).
    pub fn minor_units(&self) -> u32 {
        iso_currency::Currency::from_code(self.as_str()).and_then(|c| c.exponent()).map_or(MAX_SCALE, u32::from)
    }

    /// The three-letter code.
    pub fn as_str(&self) -> &str {
        // Only ASCII upper-case letters are ever stored.
        std::str::from_utf8(&self.0).unwrap_or("XXX")
    }
}

impl fmt::Display for Currency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An amount in a currency, never finer than the currency's minor unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Money {
    /// The amount.
    pub amount: Amount,
    /// Its currency.
    pub currency: Currency,
}

impl Money {
    /// Refuses an amount with more decimal places than `currency` has minor units.
    pub fn new(amount: Amount, currency: Currency) -> Result<Self, MoneyError> {
        check_minor_units(amount, currency)?;
        Ok(Self { amount, currency })
    }
}

/// Active codes of the ISO 4217 table (the iso_currency crate): superseded codes, funds and the special
/// codes (precious metals, testing, "no currency"), which have no minor unit, are refused.
fn accepted(c: iso_currency::Currency) -> bool {
    c.exponent().is_some() && c.is_superseded().is_none() && !c.is_fund()
}

/// Whether `amount` fits `currency`'s minor unit (`12.345 EUR` does not; `12.340` does).
pub fn check_minor_units(amount: Amount, currency: Currency) -> Result<(), MoneyError> {
    let allowed = currency.minor_units();
    if amount.value().normalize().scale() > allowed {
        return Err(MoneyError::FinerThanMinorUnit { currency: currency.as_str().to_owned(), minor_units: allowed });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn amounts_fit_their_currency_minor_units() {
        let m = |a: &str, c: &str| Money::new(Amount::parse(a).expect("amount"), Currency::parse(c).expect("cur"));
        assert!(m("10", "JPY").is_ok());
        assert!(matches!(m("10.5", "JPY"), Err(MoneyError::FinerThanMinorUnit { minor_units: 0, .. })));
        assert!(m("12.34", "EUR").is_ok() && m("12.340", "EUR").is_ok());
        assert!(matches!(m("12.345", "EUR"), Err(MoneyError::FinerThanMinorUnit { minor_units: 2, .. })));
        assert!(m("1.234", "BHD").is_ok());
        assert!(matches!(m("1.2345", "BHD"), Err(MoneyError::FinerThanMinorUnit { minor_units: 3, .. })));
        assert_eq!(format_amount(Decimal::new(123_000, 4), "EUR"), "12.30");
        assert_eq!(format_amount(Decimal::new(10_000_000, 4), "JPY"), "1000");
        assert_eq!(format_amount(Decimal::new(12_340, 4), "BHD"), "1.234");
    }

    #[test]
    fn parses_plain_amounts_to_scale_4() {
        assert_eq!(Amount::parse("12.34").map(|a| a.to_string()), Ok("12.3400".into()));
        assert_eq!(Amount::parse("12.3400").map(|a| a.to_string()), Ok("12.3400".into()));
        assert_eq!(Amount::parse("0.0001").map(|a| a.to_string()), Ok("0.0001".into()));
        assert_eq!(Amount::parse("999999999999999.9999").map(|a| a.to_string()), Ok("999999999999999.9999".into()));
        assert_eq!(Amount::parse("1.500000").map(|a| a.to_string()), Ok("1.5000".into()));
    }

    #[test]
    fn rejects_bad_amounts_with_typed_errors() {
        for (input, want) in [
            ("", MoneyError::Malformed),
            ("-1", MoneyError::Malformed),
            ("+1", MoneyError::Malformed),
            ("1e3", MoneyError::Malformed),
            (" 1", MoneyError::Malformed),
            ("1.", MoneyError::Malformed),
            (".5", MoneyError::Malformed),
            ("1,5", MoneyError::Malformed),
            ("NaN", MoneyError::Malformed),
            ("0", MoneyError::NotPositive),
            ("0.0000", MoneyError::NotPositive),
            ("1.00001", MoneyError::TooPrecise),
            ("1000000000000000", MoneyError::TooLarge),
        ] {
            assert_eq!(Amount::parse(input), Err(want), "input {input:?}");
        }
    }

    #[test]
    fn decimal_conversion_applies_the_same_rules() {
        assert_eq!(Amount::try_from(Decimal::new(-5, 0)), Err(MoneyError::NotPositive));
        assert_eq!(Amount::try_from(Decimal::new(1, 5)), Err(MoneyError::TooPrecise));
        assert_eq!(Amount::try_from(Decimal::new(10_i64.pow(15), 0)), Err(MoneyError::TooLarge));
    }

    #[test]
    fn currencies() {
        assert_eq!(Currency::parse("EUR").map(|c| c.to_string()), Ok("EUR".into()));
        assert_eq!(Currency::parse("eur"), Err(MoneyError::MalformedCurrency));
        assert_eq!(Currency::parse("EURO"), Err(MoneyError::MalformedCurrency));
        assert_eq!(Currency::parse("ÉUR"), Err(MoneyError::MalformedCurrency));
        assert_eq!(Currency::parse("ABC"), Err(MoneyError::UnknownCurrency("ABC".into())));
    }

    proptest! {
        #[test]
        fn amount_parser_never_panics(s in "\\PC{0,80}") {
            let _ = Amount::parse(&s);
        }

        #[test]
        fn valid_amounts_round_trip(int in 0u64..999_999_999_999_999, frac in 0u32..10_000) {
            prop_assume!(int > 0 || frac > 0);
            let text = format!("{int}.{frac:04}");
            let amount = Amount::parse(&text).expect("valid amount");
            prop_assert_eq!(amount.to_string(), text);
            prop_assert!(amount.value().scale() == MAX_SCALE);
        }

        #[test]
        fn currency_parser_never_panics(s in "\\PC{0,8}") {
            let _ = Currency::parse(&s);
        }
    }
}
