//! The CUDA IPC transport's core, without CUDA: how many operations are in flight on the stream
//! (bounded by `max_write_queue_size`), what a completed flush proves, and which pinned token
//! slots are free. The shell in `conn/cuda_ipc.rs` holds it under one lock while it enqueues, so
//! a flush's ticket counts only operations already on the stream.

/// What a flush saw when it began: once the stream has drained after this point, every
/// operation counted here has run, and the slots handed out so far are no longer read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct FlushTicket {
    issued: u64,
    handed_out: usize,
    /// Hand-outs (not positions) so far, to see whether any came after the ticket.
    hand_outs: u64,
}

impl FlushTicket {
    /// The operations the ticket covers (the issued count when it was taken).
    pub(crate) fn issued(&self) -> u64 {
        self.issued
    }
}

/// Where the next token value goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TokenSlot {
    /// Pinned slot `i`, untouched until a flush that began after this hand-out completed.
    Pinned(usize),
    /// No free slot: write the token with a stream memory operation (`cuStreamWriteValue64`);
    /// where that is missing, the shell calls [`IpcCore::enter_event_mode`].
    WriteValue,
    /// Event mode: slot `i`, once the event recorded behind its last copy has passed.
    Event(usize),
}

/// Accounting and token slots of one CUDA IPC connection.
///
/// The caller must take a slot and enqueue the copy that reads it with no
/// [`begin_flush`](Self::begin_flush) in between (the shell holds one lock over both): a flush
/// ticket taken between them would free the slot before its copy is on the stream.
#[derive(Clone, Debug)]
pub(crate) struct IpcCore {
    /// `max_write_queue_size` (at least 1).
    max_queue: usize,
    /// Operations enqueued on the stream.
    issued: u64,
    /// Every operation below this is known to have run (a flush proved it).
    completed: u64,
    slots: usize,
    /// The next slot to hand out (flush-freed mode), or the next to reuse (event mode).
    next: usize,
    hand_outs: u64,
    /// Once set, slots are recycled by events in a ring and no longer freed by flushes.
    event_mode: bool,
}

impl IpcCore {
    pub(crate) fn new(max_queue: usize, slots: usize) -> IpcCore {
        IpcCore {
            max_queue: max_queue.max(1),
            issued: 0,
            completed: 0,
            slots: slots.max(1),
            next: 0,
            hand_outs: 0,
            event_mode: false,
        }
    }

    pub(crate) fn max_queue(&self) -> usize {
        self.max_queue
    }

    /// Operations enqueued so far (the sequence number of the last one).
    pub(crate) fn issued(&self) -> u64 {
        self.issued
    }

    /// Every operation up to this sequence number is known to have run.
    pub(crate) fn completed(&self) -> u64 {
        self.completed
    }

    /// Operations issued and not yet proven to have run.
    pub(crate) fn outstanding(&self) -> u64 {
        self.issued - self.completed
    }

    /// Whether one more operation fits under the bound (otherwise the shell waits for the
    /// stream, then calls [`flush_done`](Self::flush_done)).
    pub(crate) fn can_issue(&self) -> bool {
        self.outstanding() < self.max_queue as u64
    }

    /// Records one operation enqueued on the stream.
    pub(crate) fn on_issued(&mut self) {
        self.issued += 1;
    }

    /// Operations between two completion marks (events the shell records so that a full queue
    /// waits for its oldest half rather than for the whole stream): half the queue, at least 1.
    pub(crate) fn mark_every(&self) -> u64 {
        (self.max_queue as u64 / 2).max(1)
    }

    /// Whether the operation just issued ends a stretch of [`mark_every`](Self::mark_every)
    /// operations since the last proven completion.
    pub(crate) fn wants_mark(&self) -> bool {
        self.outstanding() >= self.mark_every()
    }

    /// A flush begins now.
    pub(crate) fn begin_flush(&self) -> FlushTicket {
        FlushTicket { issued: self.issued, handed_out: self.next, hand_outs: self.hand_outs }
    }

    /// The stream drained after `t` was taken: its operations have run, and its slots are free
    /// when nothing was handed out since (hand-outs after it may still be read by pending
    /// copies; a later flush frees them all).
    pub(crate) fn flush_done(&mut self, t: FlushTicket) {
        self.completed = self.completed.max(t.issued);
        if !self.event_mode && self.hand_outs == t.hand_outs && self.next == t.handed_out {
            self.next = 0;
        }
    }

    /// Where the next token goes.
    pub(crate) fn take_slot(&mut self) -> TokenSlot {
        if self.event_mode {
            let i = self.next;
            self.next = (i + 1) % self.slots;
            self.hand_outs += 1;
            return TokenSlot::Event(i);
        }
        if self.next < self.slots {
            let i = self.next;
            self.next += 1;
            self.hand_outs += 1;
            return TokenSlot::Pinned(i);
        }
        TokenSlot::WriteValue
    }

    /// Whether slots are recycled by events.
    #[cfg(test)]
    pub(crate) fn event_mode(&self) -> bool {
        self.event_mode
    }

    /// Switches to event-recycled slots; the shell has drained the stream first (slots handed
    /// out before may still be read otherwise).
    pub(crate) fn enter_event_mode(&mut self) {
        self.event_mode = true;
        self.next = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Clone, Debug)]
    enum Step {
        /// Issue a write (waiting for a flush first when the bound is reached).
        Write,
        /// Issue a token (takes a slot).
        Token,
        /// A flush begins.
        BeginFlush,
        /// The stream runs everything enqueued so far: every open flush has seen it idle.
        Drain,
        /// Flush `i % drained` (one that saw the stream idle) returns, maybe much later.
        Complete(usize),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            3 => Just(Step::Write),
            3 => Just(Step::Token),
            1 => Just(Step::BeginFlush),
            1 => Just(Step::Drain),
            1 => (0usize..4).prop_map(Step::Complete),
        ]
    }

    /// A model stream: operations run in order; a pinned slot is read when its copy runs.
    struct Model {
        core: IpcCore,
        /// Operations enqueued and not yet run; `Some(slot)` for a token copy from a slot.
        pending: Vec<Option<usize>>,
        open: Vec<FlushTicket>,
        /// Flushes that saw the stream idle and have not returned yet.
        drained: Vec<FlushTicket>,
        ran: u64,
    }

    impl Model {
        /// Enqueues a write, or with `token` a token copy, the way the shell does: waits (drains)
        /// while the bound is reached, then, without a flush beginning in between, takes a slot
        /// and enqueues the copy that reads it.
        fn issue(&mut self, token: bool) {
            if !self.core.can_issue() {
                let t = self.core.begin_flush();
                self.run_all();
                self.core.flush_done(t);
            }
            assert!(self.core.can_issue(), "a drained stream leaves room");
            let slot = match token.then(|| self.core.take_slot()) {
                Some(TokenSlot::Pinned(i)) => {
                    assert!(i < self.core.slots);
                    assert!(!self.pending.contains(&Some(i)), "slot {i} handed out while a pending copy reads it");
                    Some(i)
                }
                Some(TokenSlot::Event(_)) => unreachable!("the model never enters event mode"),
                Some(TokenSlot::WriteValue) | None => None,
            };
            self.pending.push(slot);
            self.core.on_issued();
            assert!(self.core.outstanding() as usize <= self.core.max_queue(), "past the bound");
        }

        fn run_all(&mut self) {
            self.ran += self.pending.len() as u64;
            self.pending.clear();
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Random writes, tokens and flushes (returning late, after later hand-outs): the
        /// in-flight count never passes the bound, no slot is handed out while a pending copy
        /// reads it, and a completed flush proves only operations that ran.
        #[test]
        fn random_schedules_keep_the_bound_and_the_slots(
            queue in 1usize..10,
            slots in 1usize..6,
            steps in prop::collection::vec(step(), 1..300),
        ) {
            let mut m = Model {
                core: IpcCore::new(queue, slots),
                pending: Vec::new(),
                open: Vec::new(),
                drained: Vec::new(),
                ran: 0,
            };
            for s in steps {
                match s {
                    Step::Write => m.issue(false),
                    Step::Token => m.issue(true),
                    Step::BeginFlush => m.open.push(m.core.begin_flush()),
                    Step::Drain => {
                        m.run_all();
                        let open = std::mem::take(&mut m.open);
                        m.drained.extend(open);
                    }
                    Step::Complete(i) => {
                        if !m.drained.is_empty() {
                            let t = m.drained.remove(i % m.drained.len());
                            m.core.flush_done(t);
                            prop_assert!(m.core.outstanding() <= m.core.issued - t.issued);
                        }
                    }
                }
                prop_assert!(m.core.completed <= m.ran, "counted as run before it ran");
            }
        }
    }

    #[test]
    fn a_write_past_the_bound_needs_a_flush() {
        let mut c = IpcCore::new(2, 4);
        c.on_issued();
        c.on_issued();
        assert!(!c.can_issue());
        let t = c.begin_flush();
        // The shell waits with its lock released: another thread may enqueue meanwhile.
        c.issued += 1;
        c.flush_done(t);
        assert_eq!(c.outstanding(), 1, "the operation after the ticket is not proven");
        assert!(c.can_issue());
        // Zero acts as 1.
        assert_eq!(IpcCore::new(0, 0).max_queue(), 1);
    }

    #[test]
    fn slots_run_out_and_come_back_after_a_flush() {
        let mut c = IpcCore::new(100, 3);
        assert_eq!(c.take_slot(), TokenSlot::Pinned(0));
        let early = c.begin_flush();
        assert_eq!(c.take_slot(), TokenSlot::Pinned(1));
        assert_eq!(c.take_slot(), TokenSlot::Pinned(2));
        assert_eq!(c.take_slot(), TokenSlot::WriteValue, "all slots in use since the last flush");
        c.flush_done(early);
        assert_eq!(c.take_slot(), TokenSlot::WriteValue, "slots handed out after the flush began stay taken");
        let t = c.begin_flush();
        c.flush_done(t);
        assert_eq!(c.take_slot(), TokenSlot::Pinned(0), "a flush after the last hand-out frees them all");
        // A ticket taken, then a slot handed out and the position moved back by a flush: the
        // stale ticket must not free the new hand-out.
        let stale = c.begin_flush();
        let t = c.begin_flush();
        c.flush_done(t);
        assert_eq!(c.take_slot(), TokenSlot::Pinned(0));
        c.flush_done(stale);
        assert_eq!(c.take_slot(), TokenSlot::Pinned(1), "slot 0 is still read by a pending copy");
    }

    #[test]
    fn event_mode_is_a_ring() {
        let mut c = IpcCore::new(100, 3);
        c.take_slot();
        c.enter_event_mode();
        assert!(c.event_mode());
        let got: Vec<_> = (0..5).map(|_| c.take_slot()).collect();
        assert_eq!(
            got,
            [TokenSlot::Event(0), TokenSlot::Event(1), TokenSlot::Event(2), TokenSlot::Event(0), TokenSlot::Event(1)]
        );
        let t = c.begin_flush();
        c.flush_done(t);
        assert_eq!(c.take_slot(), TokenSlot::Event(2), "flushes do not reset the event ring");
    }
}
