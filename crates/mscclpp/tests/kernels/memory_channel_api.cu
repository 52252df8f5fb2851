// Calls every MemoryChannel, MemoryDevice2DeviceSemaphore and packet method of
// mscclpp_rs/device.cuh (every template instance a kernel can ask for), so that compiling it to
// PTX and assembling it with ptxas checks the header's inline PTX. Compiled by the
// `memory_channel` test (NVRTC), no GPU needed.
#include "mscclpp_rs/device.cuh"

using namespace mscclpp;

extern "C" __global__ void d2d_semaphore_api(MemoryDevice2DeviceSemaphoreDeviceHandle s, u64* out) {
  s.signal();
  s.relaxedSignal();
  out[0] = s.poll();
  s.wait();
  s.wait(-1);
  s.relaxedWait();
  out[1] = s.wait_for(1000);
}

extern "C" __global__ void base_memory_channel_api(BaseMemoryChannelDeviceHandle ch, u64* out) {
  BaseMemoryChannelDeviceHandle copy(ch.semaphore_);
  copy.signal();
  ch.relaxedSignal();
  out[0] = ch.poll();
  ch.wait();
  ch.relaxedWait(-1);
  out[1] = ch.wait_for(1000);
}

extern "C" __global__ void memory_channel_api(MemoryChannelDeviceHandle ch, u64* out) {
  u32 tid = blockIdx.x * blockDim.x + threadIdx.x, n = gridDim.x * blockDim.x;
  out[0] = ch.read<u32>(3) + ch.read<u64>(1);
  ch.write<u32>(5, 7u);
  ch.write<int4>(2, make_int4(1, 2, 3, 4));
  ch.put(0, 64, 4096, tid, n);
  ch.put(128, 4096, tid, n);
  ch.put<4>(4, 8, 100, tid, n);
  ch.put<8>(8, 16, 1000, tid, n);
  ch.put<16, false>(0, 0, 1 << 20, tid, n);
  ch.put<8, false>(8, 1 << 10, tid, n);
  ch.get(0, 64, 4096, tid, n);
  ch.get(128, 4096, tid, n);
  ch.get<4, false>(4, 4, 12, tid, n);
  ch.get<8>(0, 0, 7, tid, n);
  ch.putPackets(0, 0, 1024, tid, n, 1);
  ch.putPackets(64, 1024, tid, n, 2);
  ch.putPackets<LL8Packet>(0, 0, 1024, tid, n, 3);
  ch.putPackets<LL8Packet>(64, 1024, tid, n, 4);
  uint2 a = ch.unpackPacket(0, 1);
  uint2 a2 = ch.unpackPacket<LL16Packet>(1, 1, 1000);
  u32 b = ch.unpackPacket<LL8Packet>(2, 3);
  out[1] = a.x + a2.y + b;
  ch.unpackPackets(0, 0, 1024, tid, n, 1, -1);
  ch.unpackPackets(0, 1024, tid, n, 1, 100);
  ch.unpackPackets<LL8Packet>(0, 0, 1024, tid, n, 3, 1000000);
  ch.unpackPackets<LL8Packet>(0, 1024, tid, n, 3, -1);
  out[2] = ch.unpackPackets_for(0, 0, 1024, tid, n, 1, 1000);
  out[3] = ch.unpackPackets_for<LL8Packet>(0, 0, 1024, tid, n, 3, 1000);
  uint2 c;
  u32 d;
  out[4] = ch.unpackPacket_for(0, 1, 1000, c) + ch.unpackPacket_for<LL8Packet>(0, 3, 1000, d) + c.x + d;
  ch.signal();
  ch.wait();
  out[5] = ch.wait_for(10);
}

extern "C" __global__ void packets_api(LL16Packet* p16, LL8Packet* p8, u64* out) {
  p16[0].write(1u, 2u, 3u);
  p16[1].write(0x0000000500000004ull, 3u);
  p16[2].write(make_uint2(6, 7), 3u);
  LL16Packet local(make_uint2(8, 9), 3u);
  p16[3] = local;
  uint2 v;
  out[0] = p16[0].readOnce(3, v);
  uint2 r = p16[0].read(3);
  uint2 r2 = p16[0].read(3, -1);
  out[1] = r.x + r2.y + p16[1].read_for(3, 1000, v) + v.x;
  p16[4].clear();
  p8[0].write(1u, 2u);
  LL8Packet l8(3u, 2u);
  p8[1] = l8;
  u32 w;
  out[2] = p8[0].readOnce(2, w) + p8[0].read(2) + p8[0].read(2, -1) + p8[1].read_for(2, 1000, w) + w;
  p8[2].clear();
  LLPacket* lp = p16;
  out[3] = lp->data1;
}
