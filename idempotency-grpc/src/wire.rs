//! A protobuf reader just large enough for the few fields this crate reads (a descriptor
//! set's methods, a request's `request_id`), so that the crate depends on no protobuf
//! library.

/// What is wrong with the bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct WireError(pub(crate) &'static str);

/// A field's value, by its wire type.
pub(crate) enum Value<'a> {
    /// A varint (wire type 0).
    Varint(u64),
    /// Length-delimited bytes (wire type 2): a string, bytes, a message.
    Bytes(&'a [u8]),
    /// A fixed 32- or 64-bit value, skipped.
    Fixed,
}

/// The fields of one message, in order: (field number, value).
pub(crate) struct Fields<'a>(pub(crate) &'a [u8]);

impl<'a> Iterator for Fields<'a> {
    type Item = Result<(u64, Value<'a>), WireError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.0.is_empty() {
            return None;
        }
        let field = self.field();
        if field.is_err() {
            self.0 = &[];
        }
        Some(field)
    }
}

impl<'a> Fields<'a> {
    fn field(&mut self) -> Result<(u64, Value<'a>), WireError> {
        let tag = self.varint()?;
        let value = match tag & 7 {
            0 => Value::Varint(self.varint()?),
            1 => self.skip(8)?,
            2 => {
                let len = usize::try_from(self.varint()?)
                    .map_err(|_| WireError("a length does not fit in memory"))?;
                let bytes = self
                    .0
                    .get(..len)
                    .ok_or(WireError("a field runs past the end"))?;
                self.0 = &self.0[len..];
                Value::Bytes(bytes)
            }
            5 => self.skip(4)?,
            _ => return Err(WireError("an unknown wire type")),
        };
        Ok((tag >> 3, value))
    }

    fn skip(&mut self, len: usize) -> Result<Value<'a>, WireError> {
        self.0 = self
            .0
            .get(len..)
            .ok_or(WireError("a field runs past the end"))?;
        Ok(Value::Fixed)
    }

    fn varint(&mut self) -> Result<u64, WireError> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let (&byte, rest) = self
                .0
                .split_first()
                .ok_or(WireError("a number runs past the end"))?;
            self.0 = rest;
            value |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err(WireError("a number is longer than 10 bytes"))
    }
}
