//! The vocabulary of collective calls: element types, reduction operations, collectives and
//! algorithms, with the names MSCCL++ and NCCL use for them.

use std::fmt;
use std::str::FromStr;

use mscclpp::{Error, Result};

/// The element type of a collective's buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DataType {
    /// 32-bit IEEE float.
    F32,
    /// 16-bit IEEE float (half).
    F16,
    /// bfloat16.
    Bf16,
    /// 32-bit signed integer.
    I32,
    /// 32-bit unsigned integer.
    U32,
}

impl DataType {
    /// Every type, in a fixed order.
    pub const ALL: [DataType; 5] = [DataType::F32, DataType::F16, DataType::Bf16, DataType::I32, DataType::U32];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DataType::F16 | DataType::Bf16 => 2,
            _ => 4,
        }
    }

    /// The suffix of this type's kernels (`f32`, `f16`, `bf16`, `i32`, `u32`).
    pub fn name(self) -> &'static str {
        match self {
            DataType::F32 => "f32",
            DataType::F16 => "f16",
            DataType::Bf16 => "bf16",
            DataType::I32 => "i32",
            DataType::U32 => "u32",
        }
    }

    /// Whether the type is a float (reductions may then accumulate in f32).
    pub fn is_float(self) -> bool {
        matches!(self, DataType::F32 | DataType::F16 | DataType::Bf16)
    }

    pub(crate) fn code(self) -> u64 {
        DataType::ALL.iter().position(|&d| d == self).unwrap_or(0) as u64
    }
}

impl fmt::Display for DataType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DataType {
    type Err = Error;
    /// Parses `f32`/`float`/`float32`, `f16`/`half`/`float16`, `bf16`/`bfloat16`, `i32`/`int`/`int32`,
    /// `u32`/`uint32` (case-insensitive; the names of nccl-tests' `-d` and torch dtypes).
    fn from_str(s: &str) -> Result<DataType> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "f32" | "float" | "float32" | "fp32" => DataType::F32,
            "f16" | "half" | "float16" | "fp16" => DataType::F16,
            "bf16" | "bfloat16" => DataType::Bf16,
            "i32" | "int" | "int32" => DataType::I32,
            "u32" | "uint32" => DataType::U32,
            _ => {
                return Err(Error::invalid_usage(format!("unknown data type {s:?}: use f32, f16, bf16, i32 or u32")));
            }
        })
    }
}

/// A reduction operation (NCCL's `ncclRedOp_t` order: sum, prod, max, min, avg).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Product.
    Prod,
    /// Minimum.
    Min,
    /// Maximum.
    Max,
    /// Sum divided by the number of ranks (integers: truncating division).
    Avg,
}

impl ReduceOp {
    /// Every operation.
    pub const ALL: [ReduceOp; 5] = [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max, ReduceOp::Avg];

    /// The operation's name (`sum`, `prod`, `min`, `max`, `avg`).
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
        }
    }

    /// The kernels' code for it (`OP_*` in the CUDA source).
    pub(crate) fn code(self) -> u64 {
        match self {
            ReduceOp::Sum => 0,
            ReduceOp::Prod => 1,
            ReduceOp::Min => 2,
            ReduceOp::Max => 3,
            ReduceOp::Avg => 4,
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ReduceOp {
    type Err = Error;
    /// Parses `sum`, `prod`, `min`, `max`, `avg` (case-insensitive).
    fn from_str(s: &str) -> Result<ReduceOp> {
        ReduceOp::ALL
            .into_iter()
            .find(|o| o.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| Error::invalid_usage(format!("unknown reduction {s:?}: use sum, prod, min, max or avg")))
    }
}

/// Which collective a call is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Collective {
    /// Every rank ends with the reduction of every rank's buffer.
    AllReduce,
    /// Every rank ends with every rank's buffer, in rank order.
    AllGather,
    /// Rank r ends with segment r of the reduction of every rank's buffer.
    ReduceScatter,
    /// Every rank ends with the root's buffer.
    Broadcast,
}

impl Collective {
    /// The kernel-name prefix (`allreduce`, `allgather`, `reducescatter`, `broadcast`).
    pub fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "allreduce",
            Collective::AllGather => "allgather",
            Collective::ReduceScatter => "reducescatter",
            Collective::Broadcast => "broadcast",
        }
    }

    /// Whether the collective reduces (takes a [`ReduceOp`] and a numeric type).
    pub fn reduces(self) -> bool {
        matches!(self, Collective::AllReduce | Collective::ReduceScatter)
    }

    pub(crate) fn code(self) -> u64 {
        match self {
            Collective::AllReduce => 1,
            Collective::AllGather => 2,
            Collective::ReduceScatter => 3,
            Collective::Broadcast => 4,
        }
    }
}

impl fmt::Display for Collective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An algorithm: how a collective moves its data.
///
/// | name | collectives | how |
/// |---|---|---|
/// | `allpair` | AllReduce | every rank sends its whole buffer to every peer as LL packets and reduces all of them (one hop; small messages) |
/// | `packet` | all four | LL packets: AllReduce reduces chunk r at rank r and sends the result to everyone (two hops); the others send each segment straight to its reader |
/// | `simple` | all four | staged through scratch in rounds, with block barriers between phases (large messages) |
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Algorithm {
    /// One-hop all-pairs LL packets (AllReduce).
    AllPair,
    /// LL packets.
    Packet,
    /// Staged copies with block barriers.
    Simple,
}

impl Algorithm {
    /// Every algorithm.
    pub const ALL: [Algorithm; 3] = [Algorithm::AllPair, Algorithm::Packet, Algorithm::Simple];

    /// The algorithm's name (`allpair`, `packet`, `simple`).
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::AllPair => "allpair",
            Algorithm::Packet => "packet",
            Algorithm::Simple => "simple",
        }
    }

    /// Whether it uses LL packets (and the packet half of the scratch).
    pub fn is_packet(self) -> bool {
        !matches!(self, Algorithm::Simple)
    }

    /// Whether it implements `c`.
    pub fn serves(self, c: Collective) -> bool {
        !matches!(
            (self, c),
            (Algorithm::AllPair, Collective::AllGather | Collective::ReduceScatter | Collective::Broadcast)
        )
    }

    pub(crate) fn code(self) -> u64 {
        match self {
            Algorithm::AllPair => 1,
            Algorithm::Packet => 2,
            Algorithm::Simple => 3,
        }
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Algorithm {
    type Err = Error;
    /// Parses an algorithm name; MSCCL++'s names (`default_allreduce_allpair_packet`,
    /// `default_allreduce_packet`, `default_allreduce_rsag`, `default_allgather_fullmesh`...) are
    /// accepted too.
    fn from_str(s: &str) -> Result<Algorithm> {
        let l = s.to_ascii_lowercase();
        let l = l.strip_prefix("default_").unwrap_or(&l);
        let l = ["allreduce_", "allgather_", "reducescatter_", "broadcast_"]
            .iter()
            .find_map(|p| l.strip_prefix(p))
            .unwrap_or(l);
        Ok(match l {
            "allpair" | "allpair_packet" => Algorithm::AllPair,
            "packet" | "ll" => Algorithm::Packet,
            "simple" | "rsag" | "fullmesh" | "fullmesh2" => Algorithm::Simple,
            _ => {
                return Err(Error::invalid_usage(format!("unknown algorithm {s:?}: use allpair, packet or simple")));
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for d in DataType::ALL {
            assert_eq!(d.name().parse::<DataType>().unwrap(), d);
        }
        for o in ReduceOp::ALL {
            assert_eq!(o.name().parse::<ReduceOp>().unwrap(), o);
        }
        for a in Algorithm::ALL {
            assert_eq!(a.name().parse::<Algorithm>().unwrap(), a);
        }
        assert_eq!("bfloat16".parse::<DataType>().unwrap(), DataType::Bf16);
        assert_eq!("default_allreduce_allpair_packet".parse::<Algorithm>().unwrap(), Algorithm::AllPair);
        assert_eq!("default_allreduce_rsag".parse::<Algorithm>().unwrap(), Algorithm::Simple);
        assert!("int8".parse::<DataType>().unwrap_err().message().contains("unknown data type"));
        assert!("xor".parse::<ReduceOp>().is_err());
        assert!("ring".parse::<Algorithm>().is_err());
    }

    #[test]
    fn allpair_serves_only_allreduce() {
        assert!(Algorithm::AllPair.serves(Collective::AllReduce));
        assert!(!Algorithm::AllPair.serves(Collective::AllGather));
        for c in [Collective::AllReduce, Collective::AllGather, Collective::ReduceScatter, Collective::Broadcast] {
            assert!(Algorithm::Packet.serves(c) && Algorithm::Simple.serves(c));
        }
    }
}
