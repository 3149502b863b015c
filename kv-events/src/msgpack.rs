//! A minimal MessagePack reader over a byte slice: just what decoding vLLM's event batches needs.
//!
//! Why not a general msgpack crate: a value-tree decoder (`rmpv`) allocates a node per element, and
//! a batch can carry tens of thousands of token ids; this reader hands out each value's head in
//! place (strings and binaries as borrowed slices), so decoding allocates only the domain
//! vectors it fills. Every read checks the remaining length first and nesting is bounded, so
//! hostile input ends in an error, never a panic, an unbounded allocation or a deep recursion.

use std::fmt;

use crate::decode::DecodeError;

/// One value's head: scalars complete, containers as their element count (the elements follow).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Head<'a> {
    Nil,
    Bool(bool),
    /// Any non-negative integer, whatever width it was encoded with.
    Uint(u64),
    /// A negative integer.
    Int(i64),
    Float(f64),
    Str(&'a [u8]),
    Bin(&'a [u8]),
    Array(u32),
    Map(u32),
    Ext,
}

/// What was found where something else was expected, for error messages: the value for scalars,
/// the size for the rest. Carries no borrowed data, so errors outlive the payload.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Found {
    /// A msgpack nil.
    Nil,
    /// A boolean.
    Bool(bool),
    /// A non-negative integer.
    Uint(u64),
    /// A negative integer.
    Int(i64),
    /// A float.
    Float(f64),
    /// A string of this many bytes.
    Str(usize),
    /// A binary of this many bytes.
    Bin(usize),
    /// An array of this many elements.
    Array(u32),
    /// A map of this many entries.
    Map(u32),
    /// A msgpack extension value.
    Ext,
}

impl fmt::Display for Found {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Found::Nil => f.write_str("nil"),
            Found::Bool(b) => write!(f, "boolean {b}"),
            Found::Uint(v) => write!(f, "integer {v}"),
            Found::Int(v) => write!(f, "integer {v}"),
            Found::Float(v) => write!(f, "float {v}"),
            Found::Str(n) => write!(f, "a string of {n} bytes"),
            Found::Bin(n) => write!(f, "binary of {n} bytes"),
            Found::Array(n) => write!(f, "an array of {n}"),
            Found::Map(n) => write!(f, "a map of {n}"),
            Found::Ext => f.write_str("a msgpack extension"),
        }
    }
}

impl Head<'_> {
    pub(crate) fn found(&self) -> Found {
        match *self {
            Head::Nil => Found::Nil,
            Head::Bool(b) => Found::Bool(b),
            Head::Uint(v) => Found::Uint(v),
            Head::Int(v) => Found::Int(v),
            Head::Float(v) => Found::Float(v),
            Head::Str(s) => Found::Str(s.len()),
            Head::Bin(b) => Found::Bin(b.len()),
            Head::Array(n) => Found::Array(n),
            Head::Map(n) => Found::Map(n),
            Head::Ext => Found::Ext,
        }
    }
}

/// A cursor over one msgpack document.
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    max_depth: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8], max_depth: usize) -> Self {
        Reader {
            buf,
            pos: 0,
            max_depth,
        }
    }

    /// Bytes not read yet: an upper bound on how many more values can follow (each takes at
    /// least one byte), used to cap pre-allocation by what the input can actually hold.
    pub(crate) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    pub(crate) fn position(&self) -> usize {
        self.pos
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&end| end <= self.buf.len())
            .ok_or(DecodeError::Truncated {
                offset: self.pos,
                needed: n,
            })?;
        let bytes = &self.buf[self.pos..end];
        self.pos = end;
        Ok(bytes)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.array::<1>()?[0])
    }

    fn u16(&mut self) -> Result<u16, DecodeError> {
        Ok(u16::from_be_bytes(self.array()?))
    }

    fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_be_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_be_bytes(self.array()?))
    }

    fn sized(&mut self, len: u32) -> Result<&'a [u8], DecodeError> {
        // u32 always fits usize on the targets this crate builds for (32 and 64 bit).
        self.take(len as usize)
    }

    fn signed(v: i64) -> Head<'a> {
        match u64::try_from(v) {
            Ok(u) => Head::Uint(u),
            Err(_) => Head::Int(v),
        }
    }

    /// Reads the next value's head (a container's elements are read by the caller after it).
    pub(crate) fn head(&mut self) -> Result<Head<'a>, DecodeError> {
        let offset = self.pos;
        let marker = self.u8()?;
        Ok(match marker {
            0x00..=0x7f => Head::Uint(u64::from(marker)),
            0x80..=0x8f => Head::Map(u32::from(marker & 0x0f)),
            0x90..=0x9f => Head::Array(u32::from(marker & 0x0f)),
            0xa0..=0xbf => Head::Str(self.sized(u32::from(marker & 0x1f))?),
            0xc0 => Head::Nil,
            0xc1 => return Err(DecodeError::ReservedMarker { offset }),
            0xc2 => Head::Bool(false),
            0xc3 => Head::Bool(true),
            0xc4 => {
                let n = self.u8()?;
                Head::Bin(self.sized(u32::from(n))?)
            }
            0xc5 => {
                let n = self.u16()?;
                Head::Bin(self.sized(u32::from(n))?)
            }
            0xc6 => {
                let n = self.u32()?;
                Head::Bin(self.sized(n)?)
            }
            0xc7 => {
                let n = self.u8()?;
                self.take(1 + usize::from(n))?;
                Head::Ext
            }
            0xc8 => {
                let n = self.u16()?;
                self.take(1 + usize::from(n))?;
                Head::Ext
            }
            0xc9 => {
                let n = self.u32()?;
                self.take(1)?;
                self.sized(n)?;
                Head::Ext
            }
            0xca => Head::Float(f64::from(f32::from_be_bytes(self.array()?))),
            0xcb => Head::Float(f64::from_be_bytes(self.array()?)),
            0xcc => Head::Uint(u64::from(self.u8()?)),
            0xcd => Head::Uint(u64::from(self.u16()?)),
            0xce => Head::Uint(u64::from(self.u32()?)),
            0xcf => Head::Uint(self.u64()?),
            0xd0 => Self::signed(i64::from(i8::from_be_bytes(self.array()?))),
            0xd1 => Self::signed(i64::from(i16::from_be_bytes(self.array()?))),
            0xd2 => Self::signed(i64::from(i32::from_be_bytes(self.array()?))),
            0xd3 => Self::signed(i64::from_be_bytes(self.array()?)),
            0xd4 => {
                self.take(2)?;
                Head::Ext
            }
            0xd5 => {
                self.take(3)?;
                Head::Ext
            }
            0xd6 => {
                self.take(5)?;
                Head::Ext
            }
            0xd7 => {
                self.take(9)?;
                Head::Ext
            }
            0xd8 => {
                self.take(17)?;
                Head::Ext
            }
            0xd9 => {
                let n = self.u8()?;
                Head::Str(self.sized(u32::from(n))?)
            }
            0xda => {
                let n = self.u16()?;
                Head::Str(self.sized(u32::from(n))?)
            }
            0xdb => {
                let n = self.u32()?;
                Head::Str(self.sized(n)?)
            }
            0xdc => Head::Array(u32::from(self.u16()?)),
            0xdd => Head::Array(self.u32()?),
            0xde => Head::Map(u32::from(self.u16()?)),
            0xdf => Head::Map(self.u32()?),
            0xe0..=0xff => Head::Int(i64::from(marker as i8)),
        })
    }

    /// Skips one whole value (a field this crate does not use).
    pub(crate) fn skip(&mut self) -> Result<(), DecodeError> {
        self.skip_at(0)
    }

    fn skip_at(&mut self, depth: usize) -> Result<(), DecodeError> {
        if depth >= self.max_depth {
            return Err(DecodeError::TooDeep {
                offset: self.pos,
                limit: self.max_depth,
            });
        }
        // A container claiming more elements than bytes remain fails on the first missing one:
        // the loop runs at most `remaining()` times.
        match self.head()? {
            Head::Array(n) => {
                for _ in 0..n {
                    self.skip_at(depth + 1)?;
                }
            }
            Head::Map(n) => {
                for _ in 0..n {
                    self.skip_at(depth + 1)?;
                    self.skip_at(depth + 1)?;
                }
            }
            _ => {}
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn heads(bytes: &[u8]) -> Vec<Head<'_>> {
        let mut r = Reader::new(bytes, 8);
        let mut out = Vec::new();
        while r.remaining() > 0 {
            out.push(r.head().expect("valid msgpack"));
        }
        out
    }

    #[test]
    fn integers_of_every_width() {
        let bytes = [
            0x05, // fixint
            0xff, // negative fixint -1
            0xcc, 0xc8, // uint8 200
            0xcd, 0x01, 0x00, // uint16 256
            0xce, 0x00, 0x01, 0x00, 0x00, // uint32 65536
            0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, // uint64 max
            0xd0, 0x80, // int8 -128
            0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0, // int64 min
            0xd1, 0x00, 0x07, // int16 7, non-negative: reads as Uint
        ];
        assert_eq!(
            heads(&bytes),
            vec![
                Head::Uint(5),
                Head::Int(-1),
                Head::Uint(200),
                Head::Uint(256),
                Head::Uint(65536),
                Head::Uint(u64::MAX),
                Head::Int(-128),
                Head::Int(i64::MIN),
                Head::Uint(7),
            ]
        );
    }

    #[test]
    fn strings_binaries_and_containers() {
        let bytes = [0xa2, b'h', b'i', 0xc4, 0x01, 0xaa, 0x92, 0x81, 0xc0];
        assert_eq!(
            heads(&bytes),
            vec![
                Head::Str(b"hi"),
                Head::Bin(&[0xaa]),
                Head::Array(2),
                Head::Map(1),
                Head::Nil
            ]
        );
    }

    #[test]
    fn truncation_and_depth_are_errors() {
        let mut r = Reader::new(&[0xcd, 0x01], 8);
        assert!(matches!(
            r.head(),
            Err(DecodeError::Truncated { offset: 1, .. })
        ));
        // A huge claimed array with nothing behind it fails on the first element.
        let mut r = Reader::new(&[0xdd, 0xff, 0xff, 0xff, 0xff], 8);
        assert!(matches!(r.skip(), Err(DecodeError::Truncated { .. })));
        let nested = [0x91u8; 20];
        let mut r = Reader::new(&nested, 8);
        assert!(matches!(
            r.skip(),
            Err(DecodeError::TooDeep { limit: 8, .. })
        ));
    }
}
