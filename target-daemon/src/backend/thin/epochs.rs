//! Where a tagged write to a live tree goes while snapshots of it seal
//! (design/thin-snapshots.md T5).
//!
//! A snapshot taken at epoch E starts *sealing*: it shares everything with
//! its live tree, and until it is sealed a write tagged 1..=E (the engines'
//! writes issued before they moved past E) lands in it too, while one
//! tagged above E lands in the live tree only. Once sealed, a write tagged
//! at or below E is refused: only a fenced writer can still send one. An
//! untagged write (0: a host that is not an nvpool engine) goes to the live
//! tree only and is never refused.
//!
//! This is the whole rule, kept pure so that the seeded simulation
//! (`tests/snapshot_sim.rs`) drives the same code the target runs. The pool
//! holds one [`TreeEpochs`] per live tree under the same lock as its pages,
//! so a write is routed and applied in one step with respect to a snapshot
//! being taken. The pool keeps each live tree's floor in its metadata
//! ([`TreeEpochs::floor`], [`TreeEpochs::with_floor`]), so a restarted
//! target still refuses what it refused before; the sealing snapshots are
//! not kept (the control plane gives them up).

/// The sealing snapshots of one live tree and the highest sealed epoch.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TreeEpochs {
    /// (epoch, snapshot tree) of each snapshot still sealing.
    sealing: Vec<(u32, u64)>,
    /// Writes tagged 1..=floor are refused.
    floor: u32,
}

/// A write tagged at or below a sealed snapshot's epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fenced {
    pub tag: u32,
    pub floor: u32,
}

impl TreeEpochs {
    /// Nothing sealing, and writes tagged 1..=`floor` refused: a live tree
    /// as a reopened pool finds it.
    pub fn with_floor(floor: u32) -> TreeEpochs {
        TreeEpochs {
            sealing: Vec::new(),
            floor,
        }
    }

    /// The highest sealed epoch (0: none): writes tagged 1..=floor are
    /// refused.
    pub fn floor(&self) -> u32 {
        self.floor
    }

    /// Whether any snapshot of the tree is still sealing.
    pub fn has_sealing(&self) -> bool {
        !self.sealing.is_empty()
    }

    /// `snapshot` starts sealing at `epoch` (> 0). False: its epoch is not
    /// above a sealed one, so writes it should take may already have been
    /// refused or gone past it.
    pub fn begin(&mut self, epoch: u32, snapshot: u64) -> bool {
        if epoch == 0 || epoch <= self.floor {
            return false;
        }
        if !self.is_sealing(snapshot) {
            self.sealing.push((epoch, snapshot));
        }
        true
    }

    pub fn is_sealing(&self, snapshot: u64) -> bool {
        self.sealing.iter().any(|&(_, s)| s == snapshot)
    }

    /// `snapshot` is complete: writes tagged at or below its epoch are
    /// refused from now on. False: it was not sealing.
    pub fn seal(&mut self, snapshot: u64) -> bool {
        let Some(i) = self.sealing.iter().position(|&(_, s)| s == snapshot) else {
            return false;
        };
        let (epoch, _) = self.sealing.swap_remove(i);
        self.floor = self.floor.max(epoch);
        true
    }

    /// `snapshot` is given up (released while sealing): no write goes to
    /// it any more, and nothing is refused on its account.
    pub fn forget(&mut self, snapshot: u64) {
        self.sealing.retain(|&(_, s)| s != snapshot);
    }

    /// The snapshot trees a write tagged `tag` lands in besides the live
    /// tree, or [`Fenced`].
    pub fn route(&self, tag: u32) -> Result<impl Iterator<Item = u64> + '_, Fenced> {
        if tag != 0 && tag <= self.floor {
            return Err(Fenced {
                tag,
                floor: self.floor,
            });
        }
        Ok(self
            .sealing
            .iter()
            .filter(move |&&(epoch, _)| tag != 0 && tag <= epoch)
            .map(|&(_, s)| s))
    }

    /// Nothing sealing and nothing refused: the entry can go.
    pub fn is_empty(&self) -> bool {
        self.sealing.is_empty() && self.floor == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(t: &TreeEpochs, tag: u32) -> Result<Vec<u64>, Fenced> {
        t.route(tag).map(|i| i.collect())
    }

    #[test]
    fn writes_before_the_cut_reach_the_sealing_snapshot_and_later_ones_do_not() {
        let mut t = TreeEpochs::default();
        assert_eq!(route(&t, 1), Ok(vec![]));
        assert!(t.begin(3, 100));
        assert!(t.begin(3, 100), "a retry");
        assert_eq!(route(&t, 2), Ok(vec![100]));
        assert_eq!(route(&t, 3), Ok(vec![100]));
        assert_eq!(route(&t, 4), Ok(vec![]));
        assert_eq!(route(&t, 0), Ok(vec![]), "untagged: live only");
        assert!(t.begin(5, 200));
        assert_eq!(route(&t, 3), Ok(vec![100, 200]));
        assert_eq!(route(&t, 5), Ok(vec![200]));
        assert!(t.seal(100));
        assert!(!t.seal(100), "no longer sealing");
        assert_eq!(route(&t, 3), Err(Fenced { tag: 3, floor: 3 }));
        assert_eq!(route(&t, 4), Ok(vec![200]));
        assert_eq!(route(&t, 0), Ok(vec![]), "untagged is never refused");
        assert!(!t.begin(2, 300), "below a sealed epoch");
        t.forget(200);
        assert_eq!(route(&t, 5), Ok(vec![]));
        assert!(!t.is_empty());
        assert!(TreeEpochs::default().is_empty());
        assert!(!TreeEpochs::default().begin(0, 1));
    }

    #[test]
    fn a_tree_restored_with_its_floor_refuses_what_it_refused_before() {
        let mut t = TreeEpochs::default();
        assert!(t.begin(4, 100) && t.seal(100));
        assert!(t.begin(6, 200));
        assert!(t.has_sealing());
        let mut back = TreeEpochs::with_floor(t.floor());
        assert_eq!(back.floor(), 4);
        assert!(!back.has_sealing() && !back.is_empty());
        assert_eq!(route(&back, 4), Err(Fenced { tag: 4, floor: 4 }));
        assert_eq!(route(&back, 5), Ok(vec![]), "the sealing one is not kept");
        assert!(!back.begin(4, 300), "not above the floor");
        assert!(back.begin(5, 300));
        assert!(TreeEpochs::with_floor(0).is_empty());
    }
}
