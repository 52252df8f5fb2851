// Calls every device method of mscclpp_rs/device.cuh, so that compiling it to PTX and assembling it
// with ptxas checks every inline-PTX instruction. Compiled by the `device_header` test (NVRTC).
#include "mscclpp_rs/device.cuh"

using namespace mscclpp;

extern "C" __global__ void fifo_api(FifoDeviceHandle fifo, u64* out) {
  ProxyTrigger t(TriggerData | TriggerFlag, 1, 2, 3, 4, 5, 6);
  u64 pos = fifo.push(t);
  fifo.sync(pos);
  out[0] = fifo.poll(pos);
  u64 pos2 = 0;
  out[1] = fifo.push_for(ProxyTrigger(TriggerSync, 0, 0, 0, 0, 0, 7), 1000000, &pos2);
  out[2] = fifo.sync_for(pos2, 1000000);
  out[3] = fifo.proxy_error();
  fifo.push(ProxyTrigger::atomicAdd(1, 8, -3, 2), -1);
  ProxyTrigger batch[3] = {t, ProxyTrigger(TriggerFlag, 0, 0, 0, 0, 0, 7), ProxyTrigger::atomicAdd(1, 8, 2, 2)};
  out[4] = fifo.push_batch(batch, 3);
  out[5] = fifo.push_batch(batch, 1, -1);
  out[6] = fifo.push_batch_for(batch, 3, 1000000, &pos2);
  out[7] = fifo.push_batch_for(batch, 2, 1000000);
  __threadfence_system();
  out[8] = fifo.push_relaxed(t);
  out[9] = fifo.push_relaxed(ProxyTrigger(TriggerFlag, 0, 0, 0, 0, 0, 7), -1);
  FifoExclusiveProducer sole(fifo);
  out[10] = sole.push(t);
  out[11] = sole.push_relaxed(t, -1);
  out[12] = sole.push_for(t, 1000000, &pos2);
  out[13] = sole.push_relaxed_for(t, 1000000);
  out[14] = sole.position();
}

extern "C" __global__ void semaphore_api(Host2DeviceSemaphoreDeviceHandle h2d,
                                         MemoryDevice2DeviceSemaphoreDeviceHandle d2d, u64* out) {
  out[0] = h2d.poll();
  h2d.wait();
  out[1] = h2d.wait_for(1000);
  d2d.signal();
  d2d.relaxedSignal();
  out[2] = d2d.poll();
  d2d.wait();
  d2d.relaxedWait(-1);
  out[3] = d2d.wait_for(1000);
}

extern "C" __global__ void port_channel_api(PortChannelDeviceHandle ch, BasePortChannelDeviceHandle base, u64* out) {
  ch.put(0, 8, 16);
  ch.put(0, 16);
  ch.signal();
  ch.putWithSignal(0, 8, 16);
  ch.putWithSignal(0, 16);
  ch.putWithSignalAndFlush(0, 8, 16);
  ch.putWithSignalAndFlush(0, 16);
  ch.flush();
  ch.atomicAdd(8, 1);
  out[0] = ch.poll();
  ch.wait();
  out[1] = ch.wait_for(1000);
  out[2] = ch.flush_for(1000);
  ProxyTrigger ts[4] = {ch.put_trigger(0, 8, 16), ch.put_with_signal_trigger(8, 0, 16), ch.signal_trigger(),
                        base.put_trigger(1, 0, 2, 8, 16)};
  ch.fifo_.push_batch(ts, 4);
  ts[0] = base.put_with_signal_trigger(1, 0, 2, 8, 16);
  ch.fifo_.push_batch(ts, 1);
  base.put(1, 0, 2, 8, 16);
  base.put(1, 2, 0, 16);
  base.putWithSignal(1, 0, 2, 8, 16);
  base.putWithSignal(1, 2, 0, 16);
  base.putWithSignalAndFlush(1, 0, 2, 8, 16, -1);
  base.putWithSignalAndFlush(1, 2, 0, 16);
  base.atomicAdd(1, 0, 5);
  base.signal();
  base.flush(-1);
  out[3] = base.flush_for(1000);
}
