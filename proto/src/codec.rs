//! The codec every generated client and server uses: prost's, except that a message which
//! does not decode is the sender's fault, INVALID_ARGUMENT (prost's codec says INTERNAL,
//! which reads as a bug of the receiver and is retried by clients as such).
use std::marker::PhantomData;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic::{Code, Status};

#[derive(Debug, Clone, Copy)]
pub struct ProstCodec<T, U> {
    _pd: PhantomData<(T, U)>,
}

impl<T, U> Default for ProstCodec<T, U> {
    fn default() -> Self {
        ProstCodec { _pd: PhantomData }
    }
}

impl<T, U> Codec for ProstCodec<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = tonic_prost::ProstEncoder<T>;
    type Decoder = CheckedDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        tonic_prost::ProstEncoder::default()
    }
    fn decoder(&mut self) -> Self::Decoder {
        CheckedDecoder(tonic_prost::ProstDecoder::default())
    }
}

/// prost's decoder with decode failures answered INVALID_ARGUMENT naming the message type.
#[derive(Debug, Clone, Default)]
pub struct CheckedDecoder<U>(tonic_prost::ProstDecoder<U>);

impl<U: prost::Message + Default> Decoder for CheckedDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        self.0.decode(buf).map_err(|s| {
            if s.code() == Code::Internal {
                let name = std::any::type_name::<U>();
                let name = name.rsplit("::").next().unwrap_or(name);
                Status::invalid_argument(format!(
                    "the message is not a valid {name} (protobuf): {}",
                    s.message()
                ))
            } else {
                s
            }
        })
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.0.buffer_settings()
    }
}
