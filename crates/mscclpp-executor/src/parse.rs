//! JSON to [`Plan`]: field by field from a `serde_json::Value`, so that every error can name the
//! JSON path of what is wrong. Unknown fields are ignored (newer MSCCL++ versions may add some).

use serde_json::{Map, Value};

use crate::error::PlanError;
use crate::model::*;

type Result<T> = std::result::Result<T, PlanError>;
type Obj = Map<String, Value>;

fn kind_of(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => format!("boolean {b}"),
        Value::Number(n) => format!("number {n}"),
        Value::String(s) => format!("string {:?}", truncate(s)),
        Value::Array(a) => format!("an array of {}", a.len()),
        Value::Object(_) => "an object".into(),
    }
}

fn truncate(s: &str) -> String {
    s.chars().take(40).collect()
}

fn type_err(path: &str, expected: &'static str, v: &Value) -> PlanError {
    PlanError::Type { path: path.to_owned(), expected, found: kind_of(v) }
}

fn object<'a>(v: &'a Value, path: &str) -> Result<&'a Obj> {
    v.as_object().ok_or_else(|| type_err(path, "an object", v))
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() { key.to_owned() } else { format!("{path}.{key}") }
}

/// The field `key` of `m`, absent when missing or null.
fn opt<'a>(m: &'a Obj, key: &str) -> Option<&'a Value> {
    m.get(key).filter(|v| !v.is_null())
}

fn req<'a>(m: &'a Obj, path: &str, key: &str) -> Result<&'a Value> {
    opt(m, key).ok_or_else(|| PlanError::Missing { path: join(path, key) })
}

fn u64_of(v: &Value, path: &str) -> Result<u64> {
    v.as_u64().ok_or_else(|| type_err(path, "a non-negative integer", v))
}

fn usize_of(v: &Value, path: &str) -> Result<usize> {
    let n = u64_of(v, path)?;
    usize::try_from(n).map_err(|_| PlanError::invalid(path, format!("{n} is too large")))
}

fn u32_of(v: &Value, path: &str) -> Result<u32> {
    let n = u64_of(v, path)?;
    u32::try_from(n).map_err(|_| PlanError::invalid(path, format!("{n} does not fit in 32 bits")))
}

fn bool_of(v: &Value, path: &str) -> Result<bool> {
    v.as_bool().ok_or_else(|| type_err(path, "a boolean", v))
}

fn str_of<'a>(v: &'a Value, path: &str) -> Result<&'a str> {
    v.as_str().ok_or_else(|| type_err(path, "a string", v))
}

fn array<'a>(v: &'a Value, path: &str) -> Result<&'a [Value]> {
    v.as_array().map(Vec::as_slice).ok_or_else(|| type_err(path, "an array", v))
}

/// The array field `key`, empty when absent.
fn opt_array<'a>(m: &'a Obj, path: &str, key: &str) -> Result<&'a [Value]> {
    match opt(m, key) {
        Some(v) => array(v, &join(path, key)),
        None => Ok(&[]),
    }
}

/// `f` of every element of `items` with its path (`path[i]`).
fn each<T>(items: &[Value], path: &str, f: impl Fn(&Value, &str) -> Result<T>) -> Result<Vec<T>> {
    items.iter().enumerate().map(|(i, x)| f(x, &format!("{path}[{i}]"))).collect()
}

fn usizes(v: &Value, path: &str) -> Result<Vec<usize>> {
    each(array(v, path)?, path, usize_of)
}

fn buffer_type(v: &Value, path: &str) -> Result<BufferType> {
    match str_of(v, path)? {
        "i" => Ok(BufferType::Input),
        "o" => Ok(BufferType::Output),
        "s" => Ok(BufferType::Scratch),
        other => Err(PlanError::invalid(path, format!("unknown buffer type {:?} (want i, o or s)", truncate(other)))),
    }
}

fn channel_type(v: &Value, path: &str) -> Result<ChannelType> {
    match str_of(v, path)? {
        "memory" => Ok(ChannelType::Memory),
        "port" => Ok(ChannelType::Port),
        "none" => Ok(ChannelType::None),
        "switch" => Err(PlanError::SwitchChannel { path: path.to_owned() }),
        other => Err(PlanError::invalid(
            path,
            format!("unknown channel type {:?} (want memory, port, switch or none)", truncate(other)),
        )),
    }
}

/// A channel type that must name real channels (memory or port).
fn comm_channel_type(v: &Value, path: &str) -> Result<ChannelType> {
    match channel_type(v, path)? {
        ChannelType::None => Err(PlanError::invalid(path, "channel type \"none\" names no channel here")),
        t => Ok(t),
    }
}

/// Parses JSON text as a plan and validates it.
pub(crate) fn parse_str(text: &str) -> Result<Plan> {
    let v: Value = serde_json::from_str(text).map_err(|e| PlanError::Json {
        line: e.line(),
        column: e.column(),
        message: e.to_string(),
    })?;
    let plan = plan(&v)?;
    crate::validate::validate(&plan)?;
    Ok(plan)
}

fn plan(v: &Value) -> Result<Plan> {
    let m = object(v, "$")?;
    let p = "";
    let protocol = match str_of(req(m, p, "protocol")?, "protocol")? {
        "Simple" => Protocol::Simple,
        "LL" => Protocol::LL,
        other => {
            return Err(PlanError::invalid(
                "protocol",
                format!("unknown protocol {:?} (want Simple or LL)", truncate(other)),
            ));
        }
    };
    let opt_u64 = |key: &str, default: u64| -> Result<u64> { opt(m, key).map_or(Ok(default), |v| u64_of(v, key)) };
    let opt_bool = |key: &str| -> Result<bool> { opt(m, key).map_or(Ok(false), |v| bool_of(v, key)) };
    let gpus_v = array(req(m, p, "gpus")?, "gpus")?;
    let gpus = each(gpus_v, "gpus", gpu)?;
    Ok(Plan {
        name: str_of(req(m, p, "name")?, "name")?.to_owned(),
        collective: str_of(req(m, p, "collective")?, "collective")?.to_owned(),
        protocol,
        inplace: bool_of(req(m, p, "inplace")?, "inplace")?,
        reuse_resources: opt_bool("reuse_resources")?,
        use_double_scratch_buffer: opt_bool("use_double_scratch_buffer")?,
        buffer_alignment: opt_u64("buffer_alignment", DEFAULT_BUFFER_ALIGNMENT)?,
        min_message_size: opt_u64("min_message_size", 0)?,
        max_message_size: opt_u64("max_message_size", u64::MAX)?,
        num_threads_per_block: match opt(m, "num_threads_per_block") {
            Some(v) => u32_of(v, "num_threads_per_block")?,
            None => DEFAULT_THREADS_PER_BLOCK,
        },
        gpus,
    })
}

fn gpu(v: &Value, p: &str) -> Result<Gpu> {
    let m = object(v, p)?;
    let chunks = |key: &str| -> Result<u64> { u64_of(req(m, p, key)?, &join(p, key)) };
    // Channels first: a switch channel is refused before anything that refers to it.
    let channels = each(opt_array(m, p, "channels")?, &join(p, "channels"), |c, cp| {
        let cm = object(c, cp)?;
        Ok(Channel {
            channel_type: comm_channel_type(req(cm, cp, "channel_type")?, &join(cp, "channel_type"))?,
            connected_to: usizes(req(cm, cp, "connected_to")?, &join(cp, "connected_to"))?,
        })
    })?;
    let remote_buffers = each(opt_array(m, p, "remote_buffers")?, &join(p, "remote_buffers"), |r, rp| {
        let rm = object(r, rp)?;
        let ap = join(rp, "access_channel_types");
        Ok(RemoteBuffer {
            rank: usize_of(req(rm, rp, "rank")?, &join(rp, "rank"))?,
            buffer_type: buffer_type(req(rm, rp, "type")?, &join(rp, "type"))?,
            access_channel_types: each(array(req(rm, rp, "access_channel_types")?, &ap)?, &ap, comm_channel_type)?,
        })
    })?;
    let semaphores = each(opt_array(m, p, "semaphores")?, &join(p, "semaphores"), |s, sp| {
        let sm = object(s, sp)?;
        Ok(Semaphore { init_value: u32_of(req(sm, sp, "init_value")?, &join(sp, "init_value"))? })
    })?;
    let tbp = join(p, "threadblocks");
    let threadblocks = each(array(req(m, p, "threadblocks")?, &tbp)?, &tbp, threadblock)?;
    Ok(Gpu {
        id: usize_of(req(m, p, "id")?, &join(p, "id"))?,
        input_chunks: chunks("input_chunks")?,
        output_chunks: chunks("output_chunks")?,
        scratch_chunks: chunks("scratch_chunks")?,
        threadblocks,
        channels,
        remote_buffers,
        semaphores,
    })
}

fn threadblock(v: &Value, p: &str) -> Result<ThreadBlock> {
    let m = object(v, p)?;
    let channels = each(opt_array(m, p, "channels")?, &join(p, "channels"), |c, cp| {
        let cm = object(c, cp)?;
        Ok(ThreadBlockChannels {
            channel_type: comm_channel_type(req(cm, cp, "channel_type")?, &join(cp, "channel_type"))?,
            channel_ids: usizes(req(cm, cp, "channel_ids")?, &join(cp, "channel_ids"))?,
            buff: opt(cm, "buff").map(|b| buffer_type(b, &join(cp, "buff"))).transpose()?,
        })
    })?;
    let remote_buffer_refs = each(opt_array(m, p, "remote_buffer_refs")?, &join(p, "remote_buffer_refs"), |r, rp| {
        let rm = object(r, rp)?;
        Ok(RemoteBufferRefs {
            access_channel_type: comm_channel_type(
                req(rm, rp, "access_channel_type")?,
                &join(rp, "access_channel_type"),
            )?,
            remote_buffer_ids: usizes(req(rm, rp, "remote_buffer_ids")?, &join(rp, "remote_buffer_ids"))?,
        })
    })?;
    let opsp = join(p, "ops");
    let ops = each(array(req(m, p, "ops")?, &opsp)?, &opsp, |o, op_path| op(o, op_path, true))?;
    Ok(ThreadBlock { id: usize_of(req(m, p, "id")?, &join(p, "id"))?, ops, channels, remote_buffer_refs })
}

fn buffer_refs(m: &Obj, p: &str, key: &str) -> Result<Vec<BufferRef>> {
    let bp = join(p, key);
    each(opt_array(m, p, key)?, &bp, |b, ep| {
        let bm = object(b, ep)?;
        let loc = if let Some(t) = opt(bm, "type") {
            BufferLoc::Local(buffer_type(t, &join(ep, "type"))?)
        } else if let Some(id) = opt(bm, "buffer_id") {
            BufferLoc::Remote(usize_of(id, &join(ep, "buffer_id"))?)
        } else if opt(bm, "switch_channel_id").is_some() {
            return Err(PlanError::SwitchChannel { path: join(ep, "switch_channel_id") });
        } else {
            return Err(PlanError::Missing { path: join(ep, "type") });
        };
        Ok(BufferRef {
            loc,
            index: u64_of(req(bm, ep, "index")?, &join(ep, "index"))?,
            size: u64_of(req(bm, ep, "size")?, &join(ep, "size"))?,
        })
    })
}

fn op(v: &Value, p: &str, top_level: bool) -> Result<Op> {
    let m = object(v, p)?;
    let np = join(p, "name");
    let name = str_of(req(m, p, "name")?, &np)?;
    let kind =
        OpKind::from_name(name).ok_or_else(|| PlanError::UnknownOp { path: np.clone(), name: truncate(name) })?;
    let channel_type = opt(m, "channel_type").map(|t| channel_type(t, &join(p, "channel_type"))).transpose()?;
    let reduce_op = match opt(m, "reduce_op") {
        None => None,
        Some(r) => Some(match str_of(r, &join(p, "reduce_op"))? {
            "sum" => ReduceOp::Sum,
            "min" => ReduceOp::Min,
            "max" => ReduceOp::Max,
            other => {
                return Err(PlanError::invalid(
                    &join(p, "reduce_op"),
                    format!("unknown reduce op {:?} (want sum, min or max)", truncate(other)),
                ));
            }
        }),
    };
    let tbg_info = match opt(m, "tbg_info") {
        None => None,
        Some(t) => {
            let tp = join(p, "tbg_info");
            let tm = object(t, &tp)?;
            Some(TbgInfo {
                tb_id: u64_of(req(tm, &tp, "tb_id")?, &join(&tp, "tb_id"))?,
                tbg_size: u64_of(req(tm, &tp, "tbg_size")?, &join(&tp, "tbg_size"))?,
            })
        }
    };
    let iter_context = match opt(m, "iter_context") {
        None => None,
        Some(t) => {
            let tp = join(p, "iter_context");
            let tm = object(t, &tp)?;
            Some(IterContext {
                unit_size: u64_of(req(tm, &tp, "unit_size")?, &join(&tp, "unit_size"))?,
                num_chunks: u64_of(req(tm, &tp, "num_chunks")?, &join(&tp, "num_chunks"))?,
            })
        }
    };
    let opsp = join(p, "ops");
    let ops = if kind == OpKind::Pipeline {
        if !top_level {
            return Err(PlanError::invalid(&np, "a pipeline inside a pipeline is not supported by MSCCL++"));
        }
        each(array(req(m, p, "ops")?, &opsp)?, &opsp, |o, op_path| op(o, op_path, false))?
    } else {
        Vec::new()
    };
    let opt_u64 = |key: &str| opt(m, key).map(|v| u64_of(v, &join(p, key))).transpose();
    let ids = |key: &str| opt(m, key).map_or(Ok(Vec::new()), |v| usizes(v, &join(p, key)));
    Ok(Op {
        kind,
        src_buff: buffer_refs(m, p, "src_buff")?,
        dst_buff: buffer_refs(m, p, "dst_buff")?,
        channel_ids: ids("channel_ids")?,
        channel_type,
        reduce_op,
        tbg_info,
        barrier_id: opt_u64("barrier_id")?,
        num_threadblocks: opt_u64("num_threadblocks")?,
        semaphore_ids: ids("semaphore_ids")?,
        iter_context,
        ops,
    })
}
