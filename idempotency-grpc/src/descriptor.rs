//! Reading which methods stream from a serialized `google.protobuf.FileDescriptorSet`,
//! with the crate's own protobuf reader ([`wire`](crate::wire)).

use std::fmt;

use crate::wire::{Fields, Value, WireError};

/// Why a file descriptor set could not be read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DescriptorError(&'static str);

impl fmt::Display for DescriptorError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "not a serialized google.protobuf.FileDescriptorSet ({}); pass the bytes that \
             protox, prost-build's file_descriptor_set_path or `protoc \
             --descriptor_set_out` wrote",
            self.0
        )
    }
}

impl std::error::Error for DescriptorError {}

/// A method found in a descriptor set: its gRPC path (`/package.Service/Method`) and
/// whether the client or the server streams.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct MethodKind {
    pub(crate) path: String,
    pub(crate) streaming: bool,
}

/// Every method of every service in the set.
pub(crate) fn methods(set: &[u8]) -> Result<Vec<MethodKind>, DescriptorError> {
    let mut methods = Vec::new();
    // FileDescriptorSet { repeated FileDescriptorProto file = 1; }
    for field in Fields(set) {
        let (1, Value::Bytes(file)) = field? else {
            continue;
        };
        // FileDescriptorProto { string package = 2; repeated ServiceDescriptorProto service = 6; }
        let mut package = "";
        let mut services = Vec::new();
        for field in Fields(file) {
            match field? {
                (2, Value::Bytes(name)) => package = text(name)?,
                (6, Value::Bytes(service)) => services.push(service),
                _ => {}
            }
        }
        for service in services {
            // ServiceDescriptorProto { string name = 1; repeated MethodDescriptorProto method = 2; }
            let mut name = "";
            let mut service_methods = Vec::new();
            for field in Fields(service) {
                match field? {
                    (1, Value::Bytes(bytes)) => name = text(bytes)?,
                    (2, Value::Bytes(method)) => service_methods.push(method),
                    _ => {}
                }
            }
            let service = if package.is_empty() {
                name.to_owned()
            } else {
                format!("{package}.{name}")
            };
            for method in service_methods {
                // MethodDescriptorProto { string name = 1; bool client_streaming = 5; bool server_streaming = 6; }
                let (mut name, mut streaming) = ("", false);
                for field in Fields(method) {
                    match field? {
                        (1, Value::Bytes(bytes)) => name = text(bytes)?,
                        (5 | 6, Value::Varint(flag)) => streaming |= flag != 0,
                        _ => {}
                    }
                }
                methods.push(MethodKind {
                    path: format!("/{service}/{name}"),
                    streaming,
                });
            }
        }
    }
    Ok(methods)
}

fn text(bytes: &[u8]) -> Result<&str, DescriptorError> {
    std::str::from_utf8(bytes).map_err(|_| DescriptorError("a name is not UTF-8"))
}

impl From<WireError> for DescriptorError {
    fn from(error: WireError) -> Self {
        Self(error.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field(number: u64, bytes: &[u8]) -> Vec<u8> {
        let mut out = vec![(number << 3 | 2) as u8];
        let mut len = bytes.len();
        while len >= 0x80 {
            out.push((len & 0x7f) as u8 | 0x80);
            len >>= 7;
        }
        out.push(len as u8);
        out.extend_from_slice(bytes);
        out
    }

    fn method(name: &str, client: bool, server: bool) -> Vec<u8> {
        let mut out = field(1, name.as_bytes());
        out.extend(field(2, b".orders.v1.In"));
        out.extend([5 << 3, u8::from(client), 6 << 3, u8::from(server)]);
        out
    }

    #[test]
    fn reads_every_method_and_whether_it_streams() {
        let mut service = field(1, b"Orders");
        for (name, client, server) in [
            ("CreateOrder", false, false),
            ("ListOrders", false, true),
            ("Upload", true, false),
            ("Chat", true, true),
        ] {
            service.extend(field(2, &method(name, client, server)));
        }
        let mut file = field(1, b"orders.proto");
        file.extend(field(2, b"orders.v1"));
        file.extend(field(6, &service));
        // An option with a fixed64 and a fixed32 field, skipped.
        file.extend([8 << 3 | 1, 0, 0, 0, 0, 0, 0, 0, 0, 9 << 3 | 5, 0, 0, 0, 0]);
        let set = field(1, &file);
        let found = methods(&set).unwrap();
        let expect = |path: &str, streaming| MethodKind {
            path: path.to_owned(),
            streaming,
        };
        assert_eq!(
            found,
            vec![
                expect("/orders.v1.Orders/CreateOrder", false),
                expect("/orders.v1.Orders/ListOrders", true),
                expect("/orders.v1.Orders/Upload", true),
                expect("/orders.v1.Orders/Chat", true),
            ]
        );
    }

    #[test]
    fn truncated_input_is_an_error() {
        let set = field(1, &field(6, &field(1, b"Orders")));
        for end in 1..set.len() {
            assert!(methods(&set[..end]).is_err(), "{end}");
        }
        assert!(methods(&[]).unwrap().is_empty());
    }
}
