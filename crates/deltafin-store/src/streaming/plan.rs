//! The plan of a pass as the engine states it: which MoE layers it walks, in which order. The
//! cache ranks what it holds by when the plan needs it next (decode walks the layers in a
//! cycle), instead of guessing the order of work from the layer numbers of requests.

/// Where each MoE layer comes in a pass, as the engine said.
#[derive(Clone, Debug, Default)]
pub(super) struct Plan {
    /// Position by layer index (`None`: not walked).
    pos: Vec<Option<usize>>,
    len: usize,
}

impl Plan {
    /// Whether this plan walks exactly `layers`, in this order (every decode step states the same
    /// plan: it is rebuilt only when it changes).
    pub(super) fn is(&self, layers: &[usize]) -> bool {
        self.len == layers.len() && layers.iter().enumerate().all(|(i, &l)| self.pos.get(l).copied().flatten() == Some(i))
    }

    pub(super) fn new(layers: &[usize]) -> Plan {
        let mut pos = vec![None; layers.iter().max().map_or(0, |l| l + 1)];
        for (i, &l) in layers.iter().enumerate() {
            pos[l] = Some(i);
        }
        Plan { pos, len: layers.len() }
    }

    /// How soon an expert of `layer` is needed again, in MoE layers, when the engine is at
    /// `current`: later layers of this pass first, then this pass's earlier layers in the next
    /// (decode walks the layers in a cycle). A layer outside the plan is needed last.
    pub(super) fn next_use(&self, layer: usize, current: usize) -> usize {
        let at = |l: usize| self.pos.get(l).copied().flatten();
        match (at(layer), at(current)) {
            (Some(a), Some(c)) if a > c => a - c,
            (Some(a), Some(c)) => self.len - c + a,
            _ => usize::MAX / 2,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Plan;

    #[test]
    fn next_use_follows_the_stated_order_and_wraps_to_the_next_pass() {
        let p = Plan::new(&[1, 2, 3, 5]);
        assert_eq!(p.next_use(2, 1), 1);
        assert_eq!(p.next_use(5, 1), 3);
        // Layers already done this pass come back in the next one, the current one last.
        assert_eq!(p.next_use(1, 3), 2);
        assert_eq!(p.next_use(3, 3), 4);
        // An order that is not ascending is followed as stated.
        let q = Plan::new(&[5, 1, 3]);
        assert_eq!(q.next_use(1, 5), 1);
        assert_eq!(q.next_use(5, 3), 1);
        // A layer outside the plan is needed last.
        assert!(q.next_use(4, 5) > q.next_use(3, 5));
        // A plan knows itself, order included.
        assert!(q.is(&[5, 1, 3]) && !q.is(&[1, 3, 5]) && !q.is(&[5, 1]));
    }
}
